"""TritonAttentionBackend against the reference implementation, run by triton's CPU interpreter.

Triton picks compiled or interpreted mode for every `@triton.jit` function,
its own standard library included, when that function is decorated, i.e. on
import. Another test module in the same pytest process may already have
imported triton in compiled mode, so the kernels run in a fresh subprocess
started with TRITON_INTERPRET=1 (this file run as a script); it prints one
JSON object of measurements and the tests below assert on them. The parent
process never imports triton.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from worker.attention.metadata import AttentionMetadata
from worker.attention.reference import reference_attention
from worker.attention.triton_backend import TritonAttentionBackend  # never imports triton itself
from triton_attention_cases import CASES, SOFTCAP_SCALE, TOLERANCE, Case, build_batch, same_cache

REPO_ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_PATH = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])  # this file run as a script
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


# ---- run inside the interpreter subprocess -------------------------------------------------

def compare_with_reference(case: Case, seed: int, scale: float, **tiles: int) -> dict[str, Any]:
    query, key, value, k_cache, v_cache, meta = build_batch(case, torch.Generator().manual_seed(seed))
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = case.kv_scales
    expected = reference_attention(query, key, value, ref_k_cache, ref_v_cache, meta, scale=scale,
                                   sliding_window=case.sliding_window, k_scale=k_scale, v_scale=v_scale,
                                   softcap=case.softcap)
    output = TritonAttentionBackend(**tiles).forward(query, key, value, k_cache, v_cache, meta, scale=scale,
                                                     sliding_window=case.sliding_window, k_scale=k_scale,
                                                     v_scale=v_scale, softcap=case.softcap)
    uncapped = reference_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, scale=scale,
                                   sliding_window=case.sliding_window, k_scale=k_scale, v_scale=v_scale)
    return {
        "cap_effect": (uncapped.float() - expected.float()).abs().max().item(),
        "same_shape_and_dtype": output.shape == query.shape and output.dtype == query.dtype,
        "caches_equal": all(same_cache(case, a, b) for a, b in ((k_cache, ref_k_cache), (v_cache, ref_v_cache))),
        "max_error": (output.float() - expected.float()).abs().max().item(),
        "max_magnitude": expected.float().abs().max().item(),
    }


def rows_changed_by_context_edit() -> dict[str, Any]:
    """Edit one cached context value of one chunk; report which output rows moved."""
    case = CASES["mixed_with_context"]
    query, key, value, k_cache, v_cache, meta = build_batch(case, torch.Generator().manual_seed(5))
    backend = TritonAttentionBackend(block_m=16, block_n=16)
    before = backend.forward(query, key, value, k_cache, v_cache, meta, scale=0.25, sliding_window=None)
    owner = meta.num_decodes + 2  # the chunk with 13 context tokens
    v_cache[int(meta.block_tables[owner, 0]), 1] += 10.0  # its position 1
    after = backend.forward(query, key, value, k_cache, v_cache, meta, scale=0.25, sliding_window=None)
    changed = (after - before).abs().amax(dim=(1, 2)) > 1e-3
    return {"changed_rows": changed.nonzero().flatten().tolist(),
            "owner_rows": list(range(meta.query_start_loc_cpu[owner], meta.query_start_loc_cpu[owner + 1]))}


def padded_decode_from_device_tensors_only() -> dict[str, Any]:
    """A pure-decode step as a CUDA-graph runner pads it: two rows with slot -1, seq_len 0 and
    block table 0 after the real decodes, and every host-side length wrong (a captured graph
    replays with the capture step's host values). Split-K (32-key partitions) runs."""
    case = Case(decode_context_lens=(3, 40, 77), partition_size=32)
    query, key, value, k_cache, v_cache, meta = build_batch(case, torch.Generator().manual_seed(7))
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    expected = reference_attention(query, key, value, ref_k_cache, ref_v_cache, meta, scale=0.25,
                                   sliding_window=None)
    pad = 2
    padded = AttentionMetadata(
        num_decodes=3 + pad, slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1)]),
        query_start_loc=torch.arange(3 + pad + 1, dtype=torch.int32),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32)]),
        block_tables=torch.cat([meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32)]),
        max_query_len=-1, max_seq_len=-1, query_start_loc_cpu=[0] * (3 + pad + 1), seq_lens_cpu=[0] * (3 + pad))
    backend = TritonAttentionBackend(block_m=16, block_n=16, partition_size=32)
    output = backend.forward(torch.cat([query, torch.randn(pad, *query.shape[1:])]),
                             torch.cat([key, torch.randn(pad, *key.shape[1:])]),
                             torch.cat([value, torch.randn(pad, *value.shape[1:])]),
                             k_cache, v_cache, padded, scale=0.25, sliding_window=None)
    return {
        "partitions": backend.decode_partitions(padded, case.block_size),
        "max_error": (output[:3] - expected).abs().max().item(),
        "padding_rows_zero": bool((output[3:] == 0).all()),
        "caches_equal": torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache),
    }


def split_equals_unsplit_within_one_partition() -> bool:
    """Sequences that fit one partition: the split path copies that partition through, so the
    output is bit-for-bit the unsplit kernel's (eager and graph-captured steps then agree)."""
    case = Case(decode_context_lens=(0, 9, 20, 31), sliding_window=12, dtype=torch.bfloat16)
    batch = build_batch(case, torch.Generator().manual_seed(9))
    outputs = []
    for partition_size in (32, 64):  # 36 table slots: split into 2 partitions, then unsplit
        query, key, value, k_cache, v_cache, meta = (t.clone() if isinstance(t, torch.Tensor) else t for t in batch)
        backend = TritonAttentionBackend(block_m=16, block_n=16, partition_size=partition_size)
        assert backend.decode_partitions(meta, case.block_size) == (2 if partition_size == 32 else 1)
        outputs.append(backend.forward(query, key, value, k_cache, v_cache, meta, scale=0.3, sliding_window=12))
    return torch.equal(*outputs)


def rejected_head_mismatch() -> str:
    query, key, value, k_cache, v_cache, meta = build_batch(Case(chunks=((0, 3),)), torch.Generator().manual_seed(0))
    try:
        TritonAttentionBackend().forward(query[:, :3], key, value, k_cache, v_cache, meta,
                                         scale=1.0, sliding_window=None)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def fp8_write_mismatches() -> dict[str, int]:
    """The cache write into 8-bit caches against torch's conversion (worker.attention.fp8_kv.to_cache):
    how many codes differ, over values of every binade, exact ties, subnormals, beyond the largest
    finite value, and NaN."""
    from worker.attention.fp8_kv import to_cache
    generator = torch.Generator().manual_seed(11)
    magnitudes = torch.exp2(torch.empty(4096).uniform_(-24, 18, generator=generator))
    signs = torch.where(torch.rand(4096, generator=generator) < 0.5, -1.0, 1.0)
    values = signs * magnitudes
    mismatches = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        codes = codes[codes.isfinite()]
        ties = (codes[:-1] + codes[1:]) / 2  # exactly between neighbours (codes sorted by sign then size)
        special = torch.tensor([0.0, -0.0, 1e9, -1e9, float("inf"), float("-inf"), float("nan"), 447.9, 464.0, 480.0])
        x = torch.cat([values, codes, ties, special])
        x = torch.cat([x, x.new_zeros(-x.numel() % 32)]).view(-1, 2, 16)  # [tokens, 2 kv heads, 16]
        scale = 0.5
        meta = AttentionMetadata(num_decodes=0, slot_mapping=torch.arange(x.shape[0]), query_start_loc=torch.zeros(1),
                                 seq_lens=torch.zeros(0), block_tables=torch.zeros(0, 1), max_query_len=0,
                                 max_seq_len=0, query_start_loc_cpu=[0], seq_lens_cpu=[])
        k_cache = torch.zeros(x.shape[0], 1, 2, 16, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        TritonAttentionBackend()._write_kv_cache(x, -x, k_cache, v_cache, meta, scale, 2.0)
        expected_k = to_cache(x, dtype, scale).view(torch.uint8).view(k_cache.shape)
        expected_v = to_cache(-x, dtype, 2.0).view(torch.uint8).view(v_cache.shape)
        mismatches[str(dtype)] = int((k_cache.view(torch.uint8) != expected_k).sum()
                                     + (v_cache.view(torch.uint8) != expected_v).sum())
    return mismatches


def kernels_interpreted() -> bool:
    from worker.attention import triton_kernels
    return triton_kernels.RUNS_INTERPRETED


def run_all_in_interpreter() -> dict[str, Any]:
    jobs: dict[str, Callable[[], Any]] = {"interpreted": kernels_interpreted}
    for name, case in CASES.items():
        # Small tiles so these tiny batches still span several query and key tiles.
        jobs[name] = lambda case=case, seed=len(name): compare_with_reference(
            case, seed, SOFTCAP_SCALE if case.softcap else case.head_dim ** -0.5, block_m=16, block_n=16,
            partition_size=case.partition_size)
    jobs["default_tiles"] = lambda: compare_with_reference(CASES["mixed_with_context"], 3, 0.3)
    jobs["context_edit"] = rows_changed_by_context_edit
    jobs["fp8_write"] = fp8_write_mismatches
    jobs["head_mismatch"] = rejected_head_mismatch
    jobs["padded_decode"] = padded_decode_from_device_tensors_only
    jobs["split_bitwise"] = split_equals_unsplit_within_one_partition
    results: dict[str, Any] = {}
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:  # reported per job so one failure does not hide the others
            results[name] = {"error": traceback.format_exc()}
    return results


# ---- run inside the compile subprocess (no TRITON_INTERPRET) --------------------------------

INT32_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
FLOAT32_POINTERS = {"part_out_ptr", "part_max_ptr", "part_sum_ptr"}  # split-K decode partials


def compile_for_sm80() -> list[str]:
    """Compile every kernel down to a cubin for an sm_80 GPU (triton ships ptxas, so no
    GPU is needed); catches what the interpreter lets through, e.g. tl.dot shape limits. The
    8-bit cache variants (bf16 queries) compile for sm_90: triton's fp8e4nv needs sm_89 or later."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.attention import triton_kernels as kernels
    from worker.attention import triton_split_kernels as split_kernels

    compiled = []
    for dtype, cache_dtype, arch in (("fp32", "fp32", 80), ("bf16", "bf16", 80), ("bf16", "fp8e4nv", 90),
                                     ("bf16", "fp8e5", 90)):
        fp8 = cache_dtype.startswith("fp8")
        launches = [
            (kernels.write_kv_cache_kernel, {"KV_HEADS_PAD": 4, "HEAD_DIM_PAD": 64, "KV_FP8": fp8,
                                             "FP8_MAX": {"fp8e4nv": 448.0, "fp8e5": 57344.0}.get(cache_dtype, 0.0),
                                             "FP8_MANTISSA": 3 if cache_dtype == "fp8e4nv" else 2,
                                             "FP8_BIAS": 7 if cache_dtype == "fp8e4nv" else 15}),
            # The soft-capped variant for 16-bit caches (Gemma 2 runs in bfloat16), plain for the others.
            (kernels.paged_decode_kernel, {"GROUP_PAD": 16, "HEAD_DIM_PAD": 64, "BLOCK_N": 32, "UPCAST_DOT": False,
                                           "KV_FP8": fp8, "USE_SOFTCAP": cache_dtype == "bf16"}),
            (kernels.paged_prefill_kernel, {"BLOCK_Q": 21, "BLOCK_M": 64, "HEAD_DIM_PAD": 64, "BLOCK_N": 32,
                                            "UPCAST_DOT": False, "KV_FP8": fp8, "USE_SOFTCAP": cache_dtype == "bf16"}),
            (split_kernels.paged_decode_split_kernel, {"GROUP_PAD": 16, "HEAD_DIM_PAD": 64, "BLOCK_N": 32,
                                                       "PARTITION_SIZE": 512, "UPCAST_DOT": False, "KV_FP8": fp8,
                                                       "USE_SOFTCAP": cache_dtype == "bf16"}),
            (split_kernels.paged_decode_reduce_kernel, {"HEAD_DIM_PAD": 64, "PARTITION_SIZE": 512}),
        ]
        for kernel, constexprs in launches:
            signature = {}
            for arg in kernel.arg_names:
                if arg in constexprs:
                    signature[arg] = "constexpr"
                elif arg == "slot_mapping_ptr":
                    signature[arg] = "*i64"
                elif arg in ("k_cache_ptr", "v_cache_ptr"):
                    signature[arg] = f"*{cache_dtype}"
                elif arg in FLOAT32_POINTERS:
                    signature[arg] = "*fp32"
                elif arg.endswith("_ptr"):
                    signature[arg] = "*i32" if arg in INT32_POINTERS else f"*{dtype}"
                else:
                    signature[arg] = "fp32" if arg.endswith("scale") or arg == "softcap" else "i32"
            source = ASTSource(fn=kernel, signature=signature,
                               constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
            binary = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            if binary.asm.get("cubin"):
                compiled.append(f"{kernel.__name__}[{cache_dtype}]")
    return compiled


# ---- the tests (parent process) -------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": SUBPROCESS_PATH}
    proc = subprocess.run([sys.executable, __file__], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def result_of(results: dict[str, Any], name: str) -> Any:
    result = results[name]
    if isinstance(result, dict) and "error" in result:
        pytest.fail(f"{name} raised in the interpreter subprocess:\n{result['error']}")
    return result


@needs_triton
def test_kernels_run_interpreted(interpreted) -> None:
    assert result_of(interpreted, "interpreted") is True


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str, interpreted) -> None:
    result = result_of(interpreted, name)
    assert result["same_shape_and_dtype"]
    assert result["caches_equal"]
    assert result["max_magnitude"] > 0.1  # a zero output would make the error check vacuous
    assert result["max_error"] <= TOLERANCE[CASES[name].cache_dtype or CASES[name].dtype]
    if CASES[name].softcap:  # the cap really changes the output: an ignored cap would fail above
        assert result["cap_effect"] > 10 * TOLERANCE[CASES[name].dtype]


@needs_triton
def test_default_tile_sizes_match_reference(interpreted) -> None:
    result = result_of(interpreted, "default_tiles")
    assert result["caches_equal"] and result["max_error"] <= 1e-5


@needs_triton
def test_context_edit_changes_exactly_its_sequence(interpreted) -> None:
    result = result_of(interpreted, "context_edit")
    assert result["changed_rows"] == result["owner_rows"]


@needs_triton
def test_fp8_cache_write_is_torchs_conversion_bit_for_bit(interpreted) -> None:
    assert result_of(interpreted, "fp8_write") == {"torch.float8_e4m3fn": 0, "torch.float8_e5m2": 0}


@needs_triton
def test_padded_decode_reads_lengths_from_device_tensors_only(interpreted) -> None:
    result = result_of(interpreted, "padded_decode")
    assert result["partitions"] == 3  # 21 blocks of 4 slots in 32-key partitions
    assert result["max_error"] <= 1e-5 and result["padding_rows_zero"] and result["caches_equal"]


@needs_triton
def test_split_decode_is_bitwise_unsplit_within_one_partition(interpreted) -> None:
    assert result_of(interpreted, "split_bitwise") is True


@needs_triton
def test_rejects_mismatched_heads(interpreted) -> None:
    assert "multiple" in result_of(interpreted, "head_mismatch")


@needs_triton
def test_kernels_compile_for_a_cuda_gpu(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=SUBPROCESS_PATH, TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__, "compile"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    names = ("write_kv_cache_kernel", "paged_decode_kernel", "paged_prefill_kernel", "paged_decode_split_kernel",
             "paged_decode_reduce_kernel")
    assert compiled == [f"{name}[{dtype}]" for dtype in ("fp32", "bf16", "fp8e4nv", "fp8e5") for name in names]


def test_rejects_tile_sizes_that_are_not_powers_of_two() -> None:
    with pytest.raises(ValueError, match="block_n"):
        TritonAttentionBackend(block_n=24)
    with pytest.raises(ValueError, match="block_m"):
        TritonAttentionBackend(block_m=8)
    with pytest.raises(ValueError, match="partition_size"):
        TritonAttentionBackend(block_n=32, partition_size=16)
    with pytest.raises(ValueError, match="partition_size"):
        TritonAttentionBackend(partition_size=96)


def test_import_needs_no_triton_and_construction_explains_missing_triton() -> None:
    script = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if triton were not installed\n"
        "import worker.attention.triton_backend as tb\n"
        "try:\n"
        "    tb.TritonAttentionBackend()\n"
        "except RuntimeError as exc:\n"
        "    assert 'triton' in str(exc), exc\n"
        "    print('clear error')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clear error"


if __name__ == "__main__":
    if sys.argv[1:] == ["compile"]:
        print(json.dumps(compile_for_sm80()))
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print(json.dumps(run_all_in_interpreter()))
    else:
        sys.exit("run with TRITON_INTERPRET=1, or with the argument 'compile'")
