"""The Triton attention kernels compiled for the GPU against the plain PyTorch reference
(worker/attention/reference.py), on the interpreter tests' cases, and a CUDA-graph
capture of a pure-decode step replayed with other lengths. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from worker.attention.metadata import AttentionMetadata
from worker.attention.reference import reference_attention
from worker.attention.triton_backend import TritonAttentionBackend
import triton_attention_cases as cases
from triton_attention_cases import CASES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"


def _on(device: str, batch):
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch[:5]) + (
        _meta_on(device, batch[5]),)


def _meta_on(device: str, meta):
    fields = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    return type(meta)(**{name: getattr(meta, name).to(device) if name in fields else getattr(meta, name)
                         for name in meta.__dataclass_fields__})


@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=16), dict(block_m=64, block_n=32)],
                         ids=["small", "default"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_kernels_match_reference(name: str, tiles: dict) -> None:
    case = CASES[name]
    batch = cases.build_batch(case, torch.Generator().manual_seed(len(name)))
    query, key, value, k_cache, v_cache, meta = batch
    scale = cases.SOFTCAP_SCALE if case.softcap else case.head_dim ** -0.5
    k_scale, v_scale = case.kv_scales
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference_attention(query, key, value, ref_k, ref_v, meta, scale=scale,
                                   sliding_window=case.sliding_window, k_scale=k_scale, v_scale=v_scale,
                                   softcap=case.softcap)
    g_query, g_key, g_value, g_k, g_v, g_meta = _on(DEVICE, batch)
    partition = max(case.partition_size, tiles["block_n"])
    output = TritonAttentionBackend(**tiles, partition_size=partition).forward(
        g_query, g_key, g_value, g_k, g_v, g_meta, scale=scale, sliding_window=case.sliding_window,
        k_scale=k_scale, v_scale=v_scale, softcap=case.softcap)
    tolerance = cases.TOLERANCE[case.cache_dtype or case.dtype]
    assert output.dtype == query.dtype
    assert (output.cpu().float() - expected.float()).abs().max().item() <= tolerance
    assert cases.same_cache(case, g_k.cpu(), ref_k) and cases.same_cache(case, g_v.cpu(), ref_v)


def test_decode_step_replays_in_a_cuda_graph_with_other_lengths() -> None:
    """Capture a padded pure-decode step (split-K: 32-key partitions over a fixed-width block
    table), then copy another step's inputs into the same buffers and replay: the output must
    be the reference's for the new lengths, the padding rows' slots (-1) untouched."""
    case = cases.Case(decode_context_lens=(3, 40, 77), partition_size=32)
    backend = TritonAttentionBackend(block_m=16, block_n=16, partition_size=32)
    steps = [cases.build_batch(case, torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    # Step 2: other lengths, the same shapes (pad its block table to step 1's width).
    case2 = cases.Case(decode_context_lens=(60, 1, 30), partition_size=32)
    steps[1] = cases.build_batch(case2, torch.Generator().manual_seed(2))
    width = max(s[5].block_tables.shape[1] for s in steps) + 4
    blocks = max(s[3].shape[0] for s in steps)
    pad = 2

    def padded(step):
        query, key, value, k_cache, v_cache, meta = step
        tables = torch.zeros(3 + pad, width, dtype=torch.int32)
        tables[:3, :meta.block_tables.shape[1]] = meta.block_tables
        caches = [torch.cat([c, torch.zeros(blocks - c.shape[0], *c.shape[1:])]) for c in (k_cache, v_cache)]
        return (torch.cat([query, torch.zeros(pad, *query.shape[1:])]),
                torch.cat([key, torch.ones(pad, *key.shape[1:])]), torch.cat([value, torch.ones(pad, *value.shape[1:])]), *caches,
                torch.cat([meta.slot_mapping, torch.full((pad,), -1)]),
                torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32)]), tables)

    buffers = [t.cuda() for t in padded(steps[0])]
    query, key, value, k_cache, v_cache, slots, seq_lens, tables = buffers
    meta = AttentionMetadata(
        num_decodes=3 + pad, slot_mapping=slots, query_start_loc=torch.arange(3 + pad + 1, dtype=torch.int32).cuda(),
        seq_lens=seq_lens, block_tables=tables, max_query_len=1, max_seq_len=0,
        query_start_loc_cpu=list(range(3 + pad + 1)), seq_lens_cpu=[0] * (3 + pad))

    def forward():
        return backend.forward(query, key, value, k_cache, v_cache, meta, scale=0.25, sliding_window=None)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    for buffer, new in zip(buffers, padded(steps[1])):
        buffer.copy_(new.cuda())
    graph.replay()
    torch.cuda.synchronize()
    q2, k2, v2, kc2, vc2, meta2 = steps[1]
    ref_k, ref_v = kc2.clone(), vc2.clone()
    expected = reference_attention(q2, k2, v2, ref_k, ref_v, meta2, scale=0.25, sliding_window=None)
    assert (output[:3].cpu() - expected).abs().max().item() <= 1e-5
    assert bool((output[3:] == 0).all())
    assert torch.equal(k_cache.cpu()[:ref_k.shape[0]], ref_k) and torch.equal(v_cache.cpu()[:ref_v.shape[0]], ref_v)
