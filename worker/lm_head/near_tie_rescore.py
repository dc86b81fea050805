"""The float32 re-score of greedy near ties of reduced-precision logits: an
option (`EngineConfig.greedy_rescore_near_ties`, `--greedy-rescore-near-ties`),
off by default so that greedy picks the argmax of the model-dtype logits as
vLLM does.

A bfloat16 lm_head hands back logits rounded to 8 significant bits (steps of
0.125 around 20), so a near tie between the top tokens is decided by
rounding, not by the model. With the option on, such ties are settled as the
float32 model would settle them: only a token whose rounded logit lies within
two rounding steps of the row's maximum can hold the largest unrounded logit.
Those few candidates are re-scored as float32 dot products of the same
hidden state and weights, and the largest wins; on an exact tie the lowest
token id wins, as with argmax. The result depends on the row alone, never on
its batch. `pagedserve bench accuracy --greedy-rescore-near-ties` shows how
often it brings bfloat16's first tokens to float32's.
"""
from __future__ import annotations

import logging

import torch

from worker.kernels import cpu_ops

logger = logging.getLogger(__name__)


def rounding_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` numbers around each value (float32 result)."""
    magnitude = values.float().abs().clamp_min(torch.finfo(dtype).tiny)
    exponent = torch.floor(torch.log2(magnitude))
    return torch.exp2(exponent) * torch.finfo(dtype).eps  # eps: the spacing at 1.0


def near_top_threshold(top: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """Two `model_dtype` rounding steps below each row's maximum `top` (float32): only
    logits at or above it can hold the largest unrounded value."""
    top = top.float()
    return top - 2 * rounding_step(top, model_dtype)


def near_top_scan(logits: torch.Tensor, model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the argmax of `logits` [N, vocab] and how many logits lie within two
    `model_dtype` rounding steps of the row's maximum (1: the argmax is settled)."""
    threshold = near_top_threshold(logits.amax(dim=-1, keepdim=True), model_dtype)
    return logits.argmax(dim=-1), (logits.float() >= threshold).sum(dim=-1)


class NearTopScan:
    """`near_top_scan`: on CPU through the C++ kernel extension when it is built (one
    read of the logits), else compiled on first use when `compile` is set (eager
    bfloat16 reductions are several times slower). A failed compile runs it eagerly."""

    def __init__(self, compile: bool, use_kernel: bool = True):
        self._use_kernel = use_kernel and cpu_ops.load() is not None
        self._compiled = torch.compile(near_top_scan, dynamic=True) if compile else None  # compiles at first call

    def warm_up(self, vocab_size: int, model_dtype: torch.dtype, device: torch.device | str) -> None:
        """Compile now rather than on the first greedy steps (a few seconds each): for
        model-dtype logits (plain greedy batches) and float32 ones (mixed batches)."""
        for logits_dtype in dict.fromkeys((model_dtype, torch.float32)):
            self(torch.zeros(2, vocab_size, dtype=logits_dtype, device=device), model_dtype)

    def __call__(self, logits: torch.Tensor, model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._use_kernel and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
            return cpu_ops.near_top_scan(logits.contiguous(), model_dtype)
        # One row is cheap eagerly, and a compiled graph would specialize on it.
        if self._compiled is None or logits.shape[0] < 2:
            return near_top_scan(logits, model_dtype)
        try:
            return self._compiled(logits, model_dtype)
        except Exception as exc:  # no C++ compiler or an inductor bug: stay correct, run eager from now on
            logger.warning("greedy near-tie scan runs eagerly (compile failed: %s)", exc)
            self._compiled = None
            return near_top_scan(logits, model_dtype)


def refine_greedy(logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                  model_dtype: torch.dtype, scan=near_top_scan) -> torch.Tensor:
    """Token ids [R] for `rows` of `logits` [N, vocab] (values rounded to `model_dtype`,
    whatever dtype holds them), re-scoring near-top candidates as float32
    `hidden[row] . weight[token]` (hidden [N, H], weight [vocab, H])."""
    every_row = rows.shape[0] == logits.shape[0]  # rows are sorted and distinct: then 0..N-1
    sub = logits if every_row else logits.index_select(0, rows)
    chosen, counts = scan(sub, model_dtype)
    tied = (counts > 1).nonzero().flatten()
    if tied.numel() == 0:
        return chosen
    sub = sub.index_select(0, tied)
    threshold = near_top_threshold(sub.amax(dim=-1, keepdim=True), model_dtype).to(sub.dtype)
    candidate_rows, tokens = (sub >= threshold).nonzero(as_tuple=True)  # row-major: ascending token ids
    hidden_rows = tied if every_row else rows.index_select(0, tied)
    return settle_near_ties(chosen, tied, hidden_rows, candidate_rows, tokens, hidden, weight)


def settle_near_ties(chosen: torch.Tensor, tied: torch.Tensor, hidden_rows: torch.Tensor,
                     candidate_rows: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """`chosen` with its `tied` rows settled: for tied row i (`hidden[hidden_rows[i]]`), of the
    candidate `tokens` whose `candidate_rows` entry is i (ascending), the one with the largest
    float32 logit, the lowest id on ties."""
    exact = (hidden.index_select(0, hidden_rows.index_select(0, candidate_rows)).float()
             * weight.index_select(0, tokens).float()).sum(dim=-1)
    best = torch.full((tied.shape[0],), float("-inf"), dtype=exact.dtype, device=exact.device)
    best = best.scatter_reduce(0, candidate_rows, exact, "amax")
    winners = exact == best.index_select(0, candidate_rows)
    settled = torch.full((tied.shape[0],), weight.shape[0], dtype=torch.int64, device=chosen.device)
    chosen[tied] = settled.scatter_reduce(0, candidate_rows[winners], tokens[winners], "amin")
    return chosen


class NearTieRescore:
    """The re-score for one lm_head `weight` [vocab, hidden] of a reduced-precision dtype."""

    def __init__(self, weight: torch.Tensor, scan: NearTopScan):
        if weight.dtype == torch.float32 or not weight.dtype.is_floating_point:
            raise ValueError(f"near ties are re-scored for reduced-precision lm_heads only, not {weight.dtype}")
        self.weight = weight
        self.model_dtype = weight.dtype
        self.scan = scan

    def pick(self, logits: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`refine_greedy` of `rows` of `logits` [N, vocab] computed from `hidden` [N, hidden]."""
        return refine_greedy(logits, rows, hidden, self.weight, self.model_dtype, self.scan)

    def settle(self, chosen: torch.Tensor, tied: torch.Tensor, candidate_rows: torch.Tensor,
               tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`settle_near_ties` of rows `tied` of `hidden` (a scan's candidates over every row)."""
        return settle_near_ties(chosen, tied, tied, candidate_rows, tokens, hidden, self.weight)

    def warm_up(self, device: torch.device | str) -> None:
        self.scan.warm_up(self.weight.shape[0], self.model_dtype, device)
