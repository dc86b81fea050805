"""What the runner, the sampler and prompt logprobs ask of the lm_head.

One `LmHead` is chosen per engine when the model is loaded
(`worker.lm_head.strategy_choice`); the strategies differ only in how fast
they find greedy tokens, never in the logits they hand out. Which token a
greedy row gets may differ between strategies in one documented case only:
the float32 re-score of near ties of reduced-precision logits
(`worker.lm_head.near_tie_rescore`), which is off unless the engine sets
`greedy_rescore_near_ties`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LmHead(ABC):
    """The final projection hidden [N, hidden] -> logits [N, vocab] and greedy picks from it."""

    weight: torch.Tensor  # [vocab, hidden], the model's lm_head (or tied embeddings), in the model dtype
    name: str  # what the strategy is, for the start-up log

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @abstractmethod
    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab], float32 when `upcast`, else the model dtype
        (enough for argmax, sampling and logprobs, which widen exactly themselves)."""

    @abstractmethod
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token [N] (int64) without materializing the logits, or None where
        this head has no such path (the caller then takes `logits` and samples). The tokens are
        the argmax of `logits(hidden)` (the first on ties), or with `rescores_near_ties` those
        `greedy_from_logits` picks for every row."""

    @property
    @abstractmethod
    def rescores_near_ties(self) -> bool:
        """Whether greedy picks differ from the argmax of `logits` (the near-tie re-score)."""

    @abstractmethod
    def greedy_from_logits(self, logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [R] of `rows` (sorted, distinct) of `logits` [N, vocab] computed by this
        head from `hidden` [N, hidden]. Called only when `rescores_near_ties`; otherwise the
        greedy token is the argmax of the logits (the first on ties), as in vLLM."""

    def wants_calibration(self) -> bool:
        """Whether `calibrate` would make greedy steps faster (see bf16_screen_calibration)."""
        return False

    def calibrate(self, hidden: torch.Tensor) -> bool:
        """Tune the greedy path on final hidden states [T, hidden] of a start-up batch; returns
        whether it is tuned. Only speed depends on it, never a token."""
        return False

    def warm_up(self, device: torch.device) -> None:
        """Compile what the first steps would otherwise compile; a no-op by default."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name
