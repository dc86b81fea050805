"""The plain lm_head: logits from one matmul, greedy from their argmax.

The matmul runs through the weight's packed copy for the CPU kernel when
there is one (`worker.models.packed_linear`), else F.linear, in the model
dtype as transformers does. Every other strategy is this one plus a faster
greedy path that picks the same tokens. Used as is where no faster path
applies: float32 without AVX-512, bfloat16 without the int8 screen, float16,
other devices.
"""
from __future__ import annotations

import torch

from worker.lm_head.interface import LmHead
from worker.lm_head.near_tie_rescore import NearTieRescore
from worker.models.packed_linear import linear


class PlainLogitsLmHead(LmHead):
    name = "plain logits"

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor | None = None,
                 near_ties: NearTieRescore | None = None):
        """`weight` [vocab, hidden]; `packed`: its packed copy (`pack_weight`), if any;
        `near_ties`: the float32 re-score of near ties, None (the default) to keep the argmax."""
        if near_ties is not None and near_ties.weight is not weight:
            raise ValueError("the near-tie re-score must score the same lm_head weight")
        self.weight = weight
        self.packed = packed
        self.near_ties = near_ties

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed)
        return logits.float() if upcast else logits

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    @property
    def rescores_near_ties(self) -> bool:
        return self.near_ties is not None

    def greedy_from_logits(self, logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.near_ties is None:
            return logits.index_select(0, rows).max(dim=-1).indices
        return self.near_ties.pick(logits, rows, hidden)

    def warm_up(self, device: torch.device) -> None:
        if self.near_ties is not None:
            self.near_ties.warm_up(device)

    def describe(self) -> str:
        """The strategy, its matmul, and for reduced-precision weights whether near ties are re-scored."""
        dtype = str(self.weight.dtype).removeprefix("torch.")
        text = f"{self.name} ({'packed' if self.packed is not None else 'plain'} {dtype} matmul"
        if self.weight.dtype != torch.float32:
            text += f", greedy near ties re-scored in float32: {'on' if self.near_ties is not None else 'off'}"
        return text + ")"
