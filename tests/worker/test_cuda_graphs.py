"""Decode CUDA graphs (worker.cuda_graphs) without a GPU: the capture is a test double that
records the captured step and replays it eagerly into the captured output, so buckets,
padding, buffer reuse and fallbacks run on CPU. The tiny-model check runs the triton kernels
in the CPU interpreter (a subprocess with TRITON_INTERPRET=1: this file run as a script),
where a replay sees only what a real graph would: the persistent buffers, never the
step's host-side lengths."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig
from common.errors import ConfigError
from worker.attention.metadata import AttentionMetadata
from worker.cuda_graphs import (DecodeGraphBuffers, DecodeGraphRunner, GraphedForward, capture_sizes,
                                graph_size_for, with_decode_graphs)

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


class EagerReplayCapture:
    """The GraphCapture double: a replay reruns the recorded step, copying into the first output."""

    def __init__(self, fail: bool = False):
        self.steps: list[Callable[[], torch.Tensor]] = []
        self.fail = fail

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        output = step()
        self.steps.append(step)
        return lambda: output.copy_(step()), output


def decode_meta(seq_lens: list[int], tables: list[list[int]], block_size: int, width: int) -> AttentionMetadata:
    n = len(seq_lens)
    block_tables = torch.zeros(n, width, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    slots = [table[(s - 1) // block_size] * block_size + (s - 1) % block_size for s, table in zip(seq_lens, tables)]
    return AttentionMetadata(
        num_decodes=n, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=list(seq_lens))


class TensorOnlyForward:
    """A forward that, like a graph's kernels, reads only device tensors: each row mixes its
    token, position, slot, length and block-table row. Records the storage of its inputs."""

    def __init__(self):
        self.input_pointers: list[tuple[int, ...]] = []

    def __call__(self, input_ids, positions, meta):
        self.input_pointers.append((input_ids.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(),
                                    meta.seq_lens.data_ptr(), meta.block_tables.data_ptr()))
        per_seq = meta.seq_lens.float() * 7 + meta.block_tables.to(torch.float32).sum(dim=1)
        if per_seq.shape[0] != input_ids.shape[0]:  # a prefill: sequences are not rows
            per_seq = torch.zeros(input_ids.shape[0])
        return torch.stack([input_ids.float(), positions.float() * 3, meta.slot_mapping.float(), per_seq], dim=1)


def graphed(max_size: int = 8, width: int = 6, capture=None) -> tuple[GraphedForward, TensorOnlyForward]:
    forward = TensorOnlyForward()
    runner = DecodeGraphRunner(forward, capture_sizes(max_size), width, CPU, capture or EagerReplayCapture())
    assert runner.capture_all()
    return GraphedForward(forward, runner), forward


def test_capture_sizes_are_vllms() -> None:
    assert capture_sizes(0) == []
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    with pytest.raises(ValueError, match="must be >= 0"):
        capture_sizes(-1)


def test_graph_size_is_the_next_bucket() -> None:
    sizes = capture_sizes(32)
    assert [graph_size_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 24, 32]
    assert graph_size_for(33, sizes) is None


def test_fill_pads_rows_and_clears_stale_columns() -> None:
    buffers = DecodeGraphBuffers(8, 5, CPU)
    pointers = [t.data_ptr() for t in (buffers.input_ids, buffers.slot_mapping, buffers.block_tables)]
    wide = decode_meta([9, 10, 11, 12, 13], [[1, 2, 3, 4]] * 5, 4, 4)
    buffers.fill(torch.arange(5), torch.arange(5) + 20, wide, 8)
    narrow = decode_meta([5, 6, 7], [[7, 8], [9, 10], [11, 12]], 4, 2)
    buffers.fill(torch.tensor([40, 41, 42]), torch.tensor([4, 5, 6]), narrow, 4)
    assert buffers.input_ids[:4].tolist() == [40, 41, 42, 0] and buffers.positions[:4].tolist() == [4, 5, 6, 0]
    assert buffers.slot_mapping[:4].tolist() == narrow.slot_mapping.tolist() + [-1]  # padding writes nowhere
    assert buffers.seq_lens[:4].tolist() == [5, 6, 7, 1]  # padding reads one token of the null block
    assert buffers.block_tables[:4].tolist() == [[7, 8, 0, 0, 0], [9, 10, 0, 0, 0], [11, 12, 0, 0, 0], [0] * 5]
    assert [t.data_ptr() for t in (buffers.input_ids, buffers.slot_mapping, buffers.block_tables)] == pointers


def test_padded_replay_matches_unpadded_eager_on_the_same_buffers() -> None:
    forward, inner = graphed()
    captured = set(inner.input_pointers)
    for n in (1, 3, 5, 8, 2):
        meta = decode_meta([4 + i for i in range(n)], [[3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(n)], 4, 3)
        ids, positions = torch.arange(n) * 5 + 1, torch.arange(n) + 3
        expected = TensorOnlyForward()(ids, positions, meta)
        calls = len(inner.input_pointers)
        with torch.inference_mode():  # as the model runner calls it
            output = forward(ids, positions, meta)
        assert torch.equal(output, expected), n
        assert set(inner.input_pointers[calls:]) <= captured  # replays read the captured buffers only
    assert forward.graphs.replays == 5 and forward.graphs.num_graphs == 4


def test_larger_prefill_and_wide_steps_run_without_graphs() -> None:
    forward, inner = graphed(max_size=4, width=2)
    ids = torch.arange(5)
    too_many = decode_meta([3] * 5, [[1]] * 5, 4, 1)
    prefill = AttentionMetadata(num_decodes=0, slot_mapping=torch.arange(5), query_start_loc=torch.tensor([0, 5]),
                                seq_lens=torch.tensor([5]), block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
                                max_query_len=5, max_seq_len=5, query_start_loc_cpu=[0, 5], seq_lens_cpu=[5])
    too_wide = decode_meta([3, 3], [[1, 2, 3], [4, 5, 6]], 1, 3)
    for step_ids, meta in ((ids, too_many), (ids, prefill), (ids[:2], too_wide)):
        calls = len(inner.input_pointers)
        with torch.inference_mode():
            output = forward(step_ids, step_ids, meta)
        assert inner.input_pointers[calls][0] == step_ids.data_ptr()  # the step's own tensors, eager
        assert output.shape[0] == step_ids.shape[0]
    assert forward.graphs.replays == 0


def test_a_failed_capture_warns_and_runs_without_graphs(caplog) -> None:
    config = EngineConfig(model="m", device="cpu", block_size=4, max_cudagraph_batch_size=8)
    forward = TensorOnlyForward()
    with caplog.at_level(logging.WARNING, logger="worker.cuda_graphs"):
        result = with_decode_graphs(forward, config, backend_name="triton", max_model_len=32, device=CPU,
                                    capture=EagerReplayCapture(fail=True))
    assert result is forward
    assert "capturing CUDA graphs failed (RuntimeError" in caplog.text


@pytest.mark.parametrize("settings,backend", [
    (dict(enforce_eager=True), "triton"), (dict(max_cudagraph_batch_size=0), "triton"), ({}, "torch")])
def test_graphs_off(settings, backend) -> None:
    config = EngineConfig(model="m", device="cpu", block_size=4, **settings)
    forward = TensorOnlyForward()
    assert with_decode_graphs(forward, config, backend_name=backend, max_model_len=32, device=CPU,
                              capture=EagerReplayCapture()) is forward
    assert forward.input_pointers == []  # nothing captured, nothing run


def test_cpu_worker_forward_is_untouched() -> None:
    config = EngineConfig(model="m", device="cpu", block_size=4)
    forward = TensorOnlyForward()
    assert with_decode_graphs(forward, config, backend_name="triton", max_model_len=32, device=CPU) is forward


def test_cpu_worker_runs_its_own_forward(tiny_hf_model, monkeypatch) -> None:
    """Not eager (graphs not switched off), but on CPU: the runner gets the plain forward."""
    import worker.compiled_forward
    import worker.worker
    for module in (worker.compiled_forward, worker.worker):  # no compiling: quick, and graphs stay on
        monkeypatch.setattr(module, "inductor_available", lambda device=None: False)
    _, directory = tiny_hf_model("LlamaForCausalLM")
    cpu_worker = worker.worker.Worker(EngineConfig(model=str(directory), dtype="float32", device="cpu",
                                                   attention_backend="torch", block_size=4,
                                                   num_gpu_blocks_override=8))
    assert cpu_worker.config.resolved_max_cudagraph_batch_size() == 256
    assert cpu_worker.runner.forward is cpu_worker.forward  # no wrapper, nothing added per step


def test_max_cudagraph_batch_size_config_and_flag() -> None:
    import argparse

    from common.cli_args import add_engine_args, engine_argv, engine_config_from_args

    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args(list(argv)))

    assert EngineConfig(model="m").resolved_max_cudagraph_batch_size() == 256
    assert EngineConfig(model="m", max_num_seqs=24).resolved_max_cudagraph_batch_size() == 24
    for wanted, max_num_seqs, resolved in ((64, 16, 16), (64, 256, 64), (0, 256, 0)):
        config = EngineConfig(model="m", max_cudagraph_batch_size=wanted, max_num_seqs=max_num_seqs)
        assert config.resolved_max_cudagraph_batch_size() == resolved
    assert EngineConfig(model="m", max_cudagraph_batch_size=64, enforce_eager=True) \
        .resolved_max_cudagraph_batch_size() == 0
    with pytest.raises(ConfigError, match="max_cudagraph_batch_size must be 0"):
        EngineConfig(model="m", max_cudagraph_batch_size=-8)
    assert parse("--model", "m").max_cudagraph_batch_size is None
    config = parse("--model", "m", "--max-cudagraph-batch-size", "64")
    assert config.max_cudagraph_batch_size == 64
    assert parse(*engine_argv(config)).max_cudagraph_batch_size == 64


# ---- the tiny model, run in a subprocess under TRITON_INTERPRET=1 ------------------------------

def padded_replay_on_tiny_model(directory: Path) -> dict:
    """A tiny random Llama on the triton kernels: three decode steps of 3 sequences (graph
    size 4) replayed from the captured graphs against the same steps eager."""
    from tiny_models import build_tiny_hf_model
    from worker.attention import get_attention_backend
    from worker.compiled_forward import ModelForward
    from worker.kv_cache import allocate_kv_caches
    from worker.model_loader import load_model

    build_tiny_hf_model("LlamaForCausalLM", directory)
    block, blocks = 4, 16
    config = EngineConfig(model=str(directory), dtype="float32", device="cpu", attention_backend="triton",
                          block_size=block, num_gpu_blocks_override=blocks, max_cudagraph_batch_size=8)
    model, hf_config, _ = load_model(config, CPU, torch.float32)
    caches = allocate_kv_caches(hf_config, blocks, block, torch.float32, CPU, max_model_len=32)
    eager = ModelForward(model, caches, get_attention_backend("triton"), max_model_len=32, compile=False)
    capture = EagerReplayCapture()
    forward = with_decode_graphs(eager, config, backend_name="triton", max_model_len=32, device=CPU, capture=capture)
    tables = [[3, 4], [5, 6, 7], [8, 9, 10]]
    prompts = [[5, 77, 130, 9, 250], [12, 240, 8, 91, 150, 33, 7, 1, 2], [60, 61, 62, 63, 64, 65]]
    for table, prompt in zip(tables, prompts):  # the prompts' K/V, eager
        n = len(prompt)
        meta = AttentionMetadata(
            num_decodes=0, slot_mapping=torch.tensor([table[p // block] * block + p % block for p in range(n)]),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.tensor([table], dtype=torch.int32), max_query_len=n, max_seq_len=n,
            query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
        with torch.inference_mode():
            eager(torch.tensor(prompt), torch.arange(n), meta)
    lens, differences, outside_slots = [len(p) for p in prompts], [], []
    for step in range(3):
        lens = [n + 1 for n in lens]
        meta = decode_meta(lens, tables, block, 3)
        ids, positions = torch.tensor([7 + step, 100 + step, 200 - step]), torch.tensor([n - 1 for n in lens])
        before = [k.clone() for k, _ in caches]
        with torch.inference_mode():
            replayed = forward(ids, positions, meta).clone()
        written = [(k != b).reshape(-1, *k.shape[2:]).any(dim=(1, 2)).nonzero().flatten().tolist()
                   for (k, _), b in zip(caches, before)]
        outside_slots.append(sorted({s for slots in written for s in slots} - set(meta.slot_mapping.tolist())))
        with torch.inference_mode():
            expected = eager(ids, positions, meta)  # rewrites the same slots with the same K/V
        differences.append(float((replayed - expected).abs().max()))
    return {"differences": differences, "outside_slots": outside_slots, "replays": forward.graphs.replays,
            "graphs": len(capture.steps), "shape": list(replayed.shape)}


@pytest.fixture(scope="module")
def tiny_model_result(tmp_path_factory) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    out = subprocess.run([sys.executable, __file__, str(tmp_path_factory.mktemp("tiny"))], env=env,
                         capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tiny_model_padded_replay_matches_eager(tiny_model_result) -> None:
    assert tiny_model_result["graphs"] == 4 and tiny_model_result["replays"] == 3
    assert tiny_model_result["shape"] == [3, 64]  # the padded row sliced away
    assert max(tiny_model_result["differences"]) < 1e-5, tiny_model_result["differences"]


def test_tiny_model_padding_writes_no_cache_slot(tiny_model_result) -> None:
    assert tiny_model_result["outside_slots"] == [[], [], []]


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(padded_replay_on_tiny_model(Path(sys.argv[1]))))
