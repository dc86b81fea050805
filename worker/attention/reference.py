"""The plainest correct paged attention: the yardstick every backend is tested against.

Loops over sequences, query tokens and heads in float32, reading keys one
cache slot at a time, so each rule of the contract is visible in one line.
Far too slow to serve with.
"""
from __future__ import annotations

import torch

from worker.attention.fp8_kv import from_cache, to_cache
from worker.attention.metadata import AttentionMetadata


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        *, scale: float, sliding_window: int | None, k_scale: float = 1.0,
                        v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D], caches [num_blocks, block_size, KVH, D].

    Writes key/value into the caches at meta.slot_mapping, then returns [T, H, D]
    in query's dtype. An 8-bit cache holds K / k_scale and V / v_scale (worker.attention.fp8_kv).
    `softcap` (Gemma 2's attention logit soft-capping): scores become tanh(s / cap) * cap
    before the mask and softmax; None or 0: no capping.
    """
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads  # query heads sharing one KV head (GQA)

    for token, slot in enumerate(meta.slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = to_cache(key[token], k_cache.dtype, k_scale)
        v_cache[block, offset] = to_cache(value[token], v_cache.dtype, v_scale)

    output = torch.empty_like(query)
    starts = meta.query_start_loc_cpu
    for seq, seq_len in enumerate(meta.seq_lens_cpu):
        query_len = starts[seq + 1] - starts[seq]
        blocks = meta.block_tables[seq].tolist()
        for i in range(query_len):
            token = starts[seq] + i
            position = seq_len - query_len + i
            first_visible = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            visible = range(first_visible, position + 1)
            keys = torch.stack([from_cache(k_cache[blocks[p // block_size], p % block_size], torch.float32, k_scale)
                                for p in visible])
            values = torch.stack([from_cache(v_cache[blocks[p // block_size], p % block_size], torch.float32,
                                             v_scale) for p in visible])
            for head in range(num_heads):
                kv_head = head // group
                scores = keys[:, kv_head] @ query[token, head].float() * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                weights = torch.softmax(scores, dim=0)
                output[token, head] = (weights @ values[:, kv_head]).to(query.dtype)
    return output
