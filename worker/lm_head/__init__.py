"""The lm_head (hidden states -> logits, and greedy tokens) as one strategy per engine,
chosen at load by `choose_lm_head`; `LmHead` is what the runner and the sampler use."""
from worker.lm_head.interface import LmHead
from worker.lm_head.strategy_choice import choose_lm_head

__all__ = ["LmHead", "choose_lm_head"]
