"""Per-step attention inputs, built once by the model runner and shared by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """A flattened, unpadded batch. Sequences are ordered decodes first.

    Query token i of sequence b is at position seq_lens[b] - query_len[b] + i.
    """

    num_decodes: int  # leading sequences with exactly one query token
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
