"""Final logit soft-capping (Gemma 2 / 3 `final_logit_softcapping`) around any lm_head strategy.

Logits become tanh(logits / cap) * cap, computed in the model dtype as transformers
does (then widened when asked), so sampling, logprobs, prompt logprobs and greedy
picks all see the capped values. Capping is monotonic but rounding can tie values
that were apart, and the greedy token is the argmax of the logits handed out (the
first on ties): the inner strategy's fused greedy path, which compares uncapped
values, is therefore not used, and greedy rows take the logits path. With the
near-tie re-score on, the inner head settles the near ties of the capped logits.
"""
from __future__ import annotations

import torch

from worker.lm_head.interface import LmHead


def soft_cap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """transformers' final soft-capping, op for op in `logits`' dtype."""
    return torch.tanh(logits / cap) * cap


class SoftcappedLmHead(LmHead):
    def __init__(self, inner: LmHead, cap: float):
        if not cap > 0:
            raise ValueError(f"final_logit_softcapping must be positive, got {cap}")
        self.inner = inner
        self.cap = float(cap)
        self.weight = inner.weight
        self.name = f"{inner.name}, final logits soft-capped at {self.cap:g}"

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        capped = soft_cap_logits(self.inner.logits(hidden, upcast=False), self.cap)
        return capped.float() if upcast else capped

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None  # the argmax of the capped logits (see the module docstring)

    @property
    def rescores_near_ties(self) -> bool:
        return self.inner.rescores_near_ties

    def greedy_from_logits(self, logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.greedy_from_logits(logits, rows, hidden)

    def warm_up(self, device: torch.device) -> None:
        self.inner.warm_up(device)

    def describe(self) -> str:
        return f"{self.inner.describe()}, final logits soft-capped at {self.cap:g}"


def with_final_softcap(head: LmHead, cap: float | None) -> LmHead:
    """`head` with its logits soft-capped at `cap`; `head` itself when cap is None or 0."""
    return SoftcappedLmHead(head, cap) if cap else head
