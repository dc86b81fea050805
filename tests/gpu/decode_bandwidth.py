"""Decode attention's memory bandwidth on the GPU: bytes of K/V the Triton decode kernels read
per step divided by their time, next to the H200's 4.8 TB/s.

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64), bfloat16 cache of
16-token blocks, block tables shuffled. Each shape runs split-K (partition 512) and unsplit
(one partition spanning the table), so the split's gain on long contexts shows. Prints one
JSON line.
"""
from __future__ import annotations

import json
import sys

import torch

from worker.attention.metadata import AttentionMetadata
from worker.attention.triton_backend import TritonAttentionBackend

H200_GBPS = 4800.0
SHAPES = ((256, 1024), (64, 4096), (8, 16384), (1, 32768))  # (sequences, context length)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def measure(num_seqs: int, context: int, partition_size: int, iterations: int = 20) -> dict:
    device, dtype = "cuda", torch.bfloat16
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32).view(-1)[:num_seqs * blocks_per_seq]
    tables = tables.view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context + 1, dtype=torch.int32, device=device)
    slots = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    meta = AttentionMetadata(num_decodes=num_seqs, slot_mapping=slots,
                             query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
                             seq_lens=seq_lens, block_tables=tables, max_query_len=1, max_seq_len=context + 1,
                             query_start_loc_cpu=list(range(num_seqs + 1)), seq_lens_cpu=[context + 1] * num_seqs)
    query = torch.randn(num_seqs, HEADS, HEAD_DIM, device=device, dtype=dtype)
    key = torch.randn(num_seqs, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    value = torch.randn_like(key)
    backend = TritonAttentionBackend(partition_size=partition_size)

    def step() -> torch.Tensor:
        return backend.forward(query, key, value, k_cache, v_cache, meta, scale=HEAD_DIM ** -0.5)

    for _ in range(3):  # compile and warm up
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        step()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / iterations
    bytes_read = num_seqs * (context + 1) * KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()  # K and V
    return {"num_seqs": num_seqs, "context": context, "partitions": backend.decode_partitions(meta, BLOCK_SIZE),
            "microseconds": round(seconds * 1e6, 1), "gb_per_s": round(bytes_read / seconds / 1e9, 1)}


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("decode_bandwidth needs a CUDA device")
    runs = []
    for num_seqs, context in SHAPES:
        table_tokens = -(-(context + 1) // BLOCK_SIZE) * BLOCK_SIZE
        for label, partition_size in (("split", 512), ("unsplit", 1 << max(table_tokens - 1, 1).bit_length())):
            runs.append({"kernel": label, **measure(num_seqs, context, partition_size)})
    best = max(run["gb_per_s"] for run in runs)
    print(json.dumps({"runs": runs, "best_gb_per_s": best, "fraction_of_h200": round(best / H200_GBPS, 3),
                      "device": torch.cuda.get_device_name()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
