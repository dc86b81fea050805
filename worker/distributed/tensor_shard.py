"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

Attention heads and MLP columns are split evenly; key/value heads too when there
are at least as many as ranks, else each rank holds the one KV head its query
heads use (replicated across ranks, as vLLM does). The vocabulary is split in
equal, padded shares (the last rank's padding rows are zero and masked out).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TensorShard:
    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's even share of `total`."""
        if total % self.size:
            raise ConfigError(f"tensor_parallel_size {self.size} does not divide the model's {total} {what}")
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank holds."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "key/value heads")
        if self.size % num_kv_heads:
            raise ConfigError(f"tensor_parallel_size {self.size} must divide, or be a multiple of, the model's "
                              f"{num_kv_heads} key/value heads")
        q_start, _ = self.split(num_heads, "attention heads")
        return q_start // (num_heads // num_kv_heads), 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first token id, padded rows per rank, real rows on this rank)."""
        rows = -(-vocab_size // self.size)
        start = self.rank * rows
        return start, rows, max(0, min(rows, vocab_size - start))
