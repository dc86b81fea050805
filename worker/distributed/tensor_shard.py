"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

Key/value heads are split across ranks, each with the query heads that attend
through it (its GQA group), so attention needs no communication. Where the KV
heads do not divide evenly (SmolLM2-135M: 3 KV heads, 9 query heads, on two
ranks) the first ranks take one more; where there are fewer KV heads than
ranks, each rank holds the one KV head its share of the query heads uses
(replicated across ranks, as vLLM does). MLP columns are split the same way
(near-equal shares). The vocabulary is split in equal, padded shares, because
the logits are gathered in equal parts (the padding rows are zero and masked).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TensorShard:
    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's near-equal share of `total` (earlier ranks take the remainder)."""
        if total < self.size:
            raise ConfigError(f"tensor_parallel_size {self.size} exceeds the model's {total} {what}")
        base, extra = divmod(total, self.size)
        return self.rank * base + min(self.rank, extra), base + (1 if self.rank < extra else 0)

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        """(first query head, query heads, first KV head, KV heads) this rank holds."""
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            kv_start, kv_count = self.split(num_kv_heads, "key/value heads")
            return kv_start * group, kv_count * group, kv_start, kv_count
        if self.size % num_kv_heads or num_heads % self.size:
            raise ConfigError(f"tensor_parallel_size {self.size} exceeds the model's {num_kv_heads} key/value "
                              f"heads: it must then be a multiple of them and divide the {num_heads} query heads")
        q_count = num_heads // self.size
        q_start = self.rank * q_count
        return q_start, q_count, q_start // group, 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first token id, padded rows per rank, real rows on this rank)."""
        rows = -(-vocab_size // self.size)
        start = self.rank * rows
        return start, rows, max(0, min(rows, vocab_size - start))
