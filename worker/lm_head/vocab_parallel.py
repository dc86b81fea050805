"""The lm_head of a tensor-parallel rank: logits for its share of the vocabulary.

Each rank scores its rows of the (padded) vocabulary with its own strategy's
matmul. Greedy rows need no full logits: each rank's best (logit, token) pair
is gathered and the highest wins, the lowest token id on ties (the first
maximum, as the argmax of the whole row). Rows that sample gather the full
logits: every rank then samples the same tokens from the same logits and seeds.
"""
from __future__ import annotations

import torch

from worker.distributed.tensor_parallel import tp_all_gather
from worker.lm_head.interface import LmHead


class VocabParallelLmHead(LmHead):
    name = "vocabulary-parallel"

    def __init__(self, local: LmHead, vocab_size: int, vocab_start: int, real_rows: int):
        """`local`: the strategy over this rank's rows [vocab_start, vocab_start + rows) (the padded
        share; `real_rows` of them are tokens); `vocab_size`: the whole vocabulary's."""
        self.local = local
        self.weight = local.weight
        self.full_vocab = vocab_size
        self.vocab_start = vocab_start
        self.real_rows = real_rows

    @property
    def vocab_size(self) -> int:
        return self.full_vocab

    def _local_logits(self, hidden: torch.Tensor, upcast: bool) -> torch.Tensor:
        logits = self.local.logits(hidden, upcast=upcast)
        if self.real_rows < logits.shape[-1]:  # padding columns must never win
            logits[:, self.real_rows:] = float("-inf")
        return logits

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        parts = tp_all_gather(self._local_logits(hidden, upcast=False))
        logits = torch.cat(parts, dim=-1)[:, :self.full_vocab]
        return logits.float() if upcast else logits

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        best, index = self._local_logits(hidden, upcast=True).max(dim=-1)
        # One gather of (logit, token id) pairs: float64 holds both exactly.
        pairs = torch.stack(tp_all_gather(torch.stack([best.double(), (index + self.vocab_start).double()])))
        winner = pairs[:, 0].max(dim=0).indices  # [rows]; the first (lowest-id) rank on ties
        return pairs[:, 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()

    @property
    def rescores_near_ties(self) -> bool:
        return False

    def greedy_from_logits(self, logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return logits.index_select(0, rows).max(dim=-1).indices

    def describe(self) -> str:
        return f"{self.name}: rows {self.vocab_start}-{self.vocab_start + self.real_rows - 1} by {self.local.describe()}"
