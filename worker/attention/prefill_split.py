"""Which sequences of a step the CPU attention kernel takes, and which PyTorch's SDPA does.

On CPUs with AMX, PyTorch's flash attention multiplies bfloat16 tiles through oneDNN and runs a
prefill or extend chunk of many query rows about twice as fast as the paged attention kernel
(docs/benchmarks.md); decodes and short chunks stay with the kernel, which reads the cache in
place. A split is built once per step and reused by every layer.
"""
from __future__ import annotations

import torch

from worker.attention.metadata import AttentionMetadata

SDPA_MIN_QUERY_ROWS = 16  # chunks of at least this many query rows go to SDPA


class KernelSplit:
    """One step's split: `kernel_runs` [(first seq, end seq, first token, end token, query_start
    relative to the run's first token)] for the kernel, `sdpa_seqs` for SDPA."""

    def __init__(self, meta: AttentionMetadata, sdpa_seqs: list[int]):
        self.sdpa_seqs = sdpa_seqs
        self.sdpa_set = frozenset(sdpa_seqs)
        self.sdpa_index = torch.tensor(sdpa_seqs, dtype=torch.int32)
        starts = meta.query_start_loc_cpu
        self.kernel_runs: list[tuple[int, int, int, int, torch.Tensor]] = []
        first = 0
        for end in [*sdpa_seqs, meta.num_seqs]:
            if end > first:
                relative = meta.query_start_loc[first:end + 1] - starts[first]
                self.kernel_runs.append((first, end, starts[first], starts[end], relative.contiguous()))
            first = end + 1


def sdpa_sequences(meta: AttentionMetadata, min_rows: int = SDPA_MIN_QUERY_ROWS) -> list[int]:
    """The sequences (after the decodes) whose chunks have at least `min_rows` query rows."""
    if meta.max_query_len < min_rows:
        return []
    starts = meta.query_start_loc_cpu
    return [s for s in range(meta.num_decodes, meta.num_seqs) if starts[s + 1] - starts[s] >= min_rows]


class KernelSplitter:
    """Keeps the step's split for every layer (the metadata object identifies the step)."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._split: KernelSplit | None = None

    def split(self, meta: AttentionMetadata) -> KernelSplit | None:
        """The step's split, or None when the kernel takes every sequence."""
        if meta is not self._meta:
            seqs = sdpa_sequences(meta)
            self._meta, self._split = meta, KernelSplit(meta, seqs) if seqs else None
        return self._split
