"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, seeds.

Everything is done on [N, vocab] tensors; no Python loop ever touches the
vocabulary. Random rows are sampled with a race over counter-based noise (see
`worker.random_race`), which lets each seeded request own its noise, so its
output does not depend on which other requests share the batch.

Before temperature and the filters the logits adjustments (min_tokens, logit_bias, penalties; see
`worker.logits_processors`) apply to greedy and random rows alike, and
requested logprobs are taken from the raw logits, before any adjustment.

Greedy rows take the argmax of the logits, as vLLM does, unless the engine's
lm_head re-scores near ties (`greedy_rescore_near_ties`, see
`worker.lm_head.near_tie_rescore`): then the greedy rows nothing adjusts are
picked by the lm_head from the logits and the hidden states.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.protocol import TokenLogprobs
from common.sampling_params import SamplingParams
from worker.lm_head.interface import LmHead
from worker.logits_processors import LogitsAdjustments
from worker.logprobs import token_logprobs
from worker.random_race import as_int64, sample_random_rows
from worker.structured_output import GrammarMatcher

_MASK_64 = (1 << 64) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for a seeded request's `num_output_tokens`-th sample.

    A pure function of (seed, index) rather than one generator advanced step
    by step: the noise for token k is then the same whether the request ran
    in a big or small batch, and also after it was preempted and re-admitted
    (the worker drops its state then). splitmix64 spreads nearby inputs over
    the whole seed space.
    """
    z = (seed + (num_output_tokens + 1) * 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters for one step, as batch tensors.

    Only the random (non-greedy) rows carry parameters; the filter tensors are
    None when none of them uses that filter, so such batches never pay for
    it, and an all-greedy batch carries nothing at all.
    """

    num_rows: int
    random_rows: torch.Tensor | None  # [R] int64 row indices; None = every row is random
    temperature: torch.Tensor | None  # [R] float32; None = all rows greedy
    top_k: torch.Tensor | None  # [R] int64, 0 = disabled
    top_p: torch.Tensor | None  # [R] float32, 1.0 = disabled
    min_p: torch.Tensor | None  # [R] float32, 0.0 = disabled
    seeds: dict[int, int]  # index among random rows -> generator seed for this step
    adjustments: LogitsAdjustments | None = None  # over all rows, before sampling
    num_logprobs: list[int | None] | None = None  # per row: top-k logprobs wanted (None: none); None: no row

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None

    def unadjusted_greedy_rows(self) -> list[int]:
        """Greedy rows whose logits no adjustment (allowed_token_ids, bad_words, min_tokens, logit_bias,
        penalties, grammars) touches."""
        if self.random_rows is None and self.temperature is not None:
            return []
        random = set(self.random_rows.tolist()) if self.random_rows is not None else set()
        adjusted = self.adjustments.rows() if self.adjustments is not None else set()
        return [row for row in range(self.num_rows) if row not in random and row not in adjusted]

    @property
    def plain_argmax(self) -> bool:
        """Every row greedy, nothing adjusts the logits, no logprobs: sampling is one argmax."""
        return self.all_greedy and self.adjustments is None and self.num_logprobs is None

    @classmethod
    def build(cls, params: list[SamplingParams], num_output_tokens: list[int] | None = None,
              device: torch.device | str = "cpu", *, token_ids: Sequence[Sequence[int]] | None = None,
              num_prompt_tokens: Sequence[int] | None = None,
              eos_token_ids: Sequence[int] = (),
              grammars: Sequence[GrammarMatcher | None] | None = None) -> "SamplingMetadata":
        """`num_output_tokens[row]`: how many tokens that request generated
        before this step (it picks a seeded request's noise, see `step_seed`).
        `token_ids[row]` (prompt + outputs) and `num_prompt_tokens[row]` feed
        the logits adjustments; without them none is applied. `grammars[row]`:
        the row's structured-output matcher, if any."""
        num_rows = len(params)
        adjustments = None
        if token_ids is not None and num_prompt_tokens is not None:
            adjustments = LogitsAdjustments.build(params, token_ids, num_prompt_tokens, eos_token_ids, device,
                                                  grammars)
        num_logprobs = [p.logprobs for p in params]
        extras = dict(adjustments=adjustments,
                      num_logprobs=num_logprobs if any(k is not None for k in num_logprobs) else None)
        random = [row for row, p in enumerate(params) if not p.greedy]
        if not random:
            return cls(num_rows, None, None, None, None, None, {}, **extras)
        chosen = [params[row] for row in random]
        top_k = [max(p.top_k, 0) for p in chosen]
        top_p = [float(p.top_p) for p in chosen]
        min_p = [float(p.min_p) for p in chosen]
        counts = num_output_tokens or [0] * num_rows
        seeds = {i: step_seed(params[row].seed, counts[row])
                 for i, row in enumerate(random) if params[row].seed is not None}

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            num_rows=num_rows,
            random_rows=None if len(random) == num_rows else tensor(random, torch.int64),
            temperature=tensor([float(p.temperature) for p in chosen], torch.float32),
            top_k=tensor(top_k, torch.int64) if any(top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(v < 1.0 for v in top_p) else None,
            min_p=tensor(min_p, torch.float32) if any(min_p) else None,
            seeds=seeds,
            **extras,
        )


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit, the first one on ties (like argmax).
    max(dim).indices gives the same ids; on CPU it is several times faster than
    argmax for bfloat16 rows."""
    return logits.max(dim=-1).indices


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: list[TokenLogprobs | None] | None  # per row, for the rows that asked; None: no row asked


class Sampler:
    """Picks one token per row of float32 logits [N, vocab]."""

    def __init__(self, seed: int = 0):
        # Noise keys for unseeded rows: reproducible per engine seed (drawn on the CPU:
        # a few numbers a step; the noise itself is computed where the logits are).
        self.generator = torch.Generator()
        self.generator.manual_seed(seed & _MASK_64)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sampled token ids [N] int64 (the logits may be adjusted in place)."""
        return self.sample(logits, meta).token_ids

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata, lm_head: LmHead | None = None,
               hidden: torch.Tensor | None = None) -> SamplerOutput:
        """Sampled token ids, and the logprobs the rows asked for. `lm_head`, the head that
        computed `logits` from `hidden` [N, hidden]: where it re-scores near ties, it picks the
        greedy rows whose logits nothing adjusts (`LmHead.greedy_from_logits`)."""
        if logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, sampling metadata {meta.num_rows}")
        rescoring = lm_head is not None and lm_head.rescores_near_ties
        if rescoring and (hidden is None or hidden.shape[0] != meta.num_rows):
            raise ValueError("an lm_head that re-scores near ties needs the hidden states of every row")
        wanted = meta.num_logprobs
        raw = rows = None
        if wanted is not None:  # from the raw logits: a copy when the adjustments will change them
            rows = [row for row, k in enumerate(wanted) if k is not None]
            every_row = len(rows) == meta.num_rows and meta.adjustments is None
            raw = logits if every_row else logits.index_select(0, torch.tensor(rows, device=logits.device))
        if meta.adjustments is not None:
            logits = meta.adjustments.apply(logits)
        rows_to_refine = meta.unadjusted_greedy_rows() if rescoring else []
        if rescoring and len(rows_to_refine) == meta.num_rows:
            # Every row plain greedy: the lm_head's own pick is the whole sampling.
            token_ids = lm_head.greedy_from_logits(logits, torch.arange(meta.num_rows, device=logits.device), hidden)
        else:
            token_ids = self._sample(logits, meta)
            if rows_to_refine:
                index = torch.tensor(rows_to_refine, device=token_ids.device)
                token_ids[index] = lm_head.greedy_from_logits(logits, index, hidden)
        if raw is None:
            return SamplerOutput(token_ids, None)
        chosen = token_ids.index_select(0, torch.tensor(rows, device=token_ids.device))
        selected = token_logprobs(raw, chosen, [wanted[row] for row in rows])
        per_row: list[TokenLogprobs | None] = [None] * meta.num_rows
        for row, entry in zip(rows, selected):
            per_row[row] = entry
        return SamplerOutput(token_ids, per_row)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # Greedy is argmax of the logits (model-dtype logits widen to float32 exactly: same argmax).
        if meta.all_greedy:
            return greedy_argmax(logits)
        if meta.random_rows is None:
            return self._sample_random(logits, meta)
        token_ids = greedy_argmax(logits)
        token_ids[meta.random_rows] = self._sample_random(logits.index_select(0, meta.random_rows), meta)
        return token_ids

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None
        keys = self._noise_keys(logits.shape[0], meta.seeds).to(logits.device)
        return sample_random_rows(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p, keys)

    def _noise_keys(self, rows: int, seeds: dict[int, int]) -> torch.Tensor:
        """One noise key per random row: a seeded row's is its step seed (independent of
        the batch), the others' come from the engine generator."""
        keys = torch.empty(rows, dtype=torch.int64).random_(generator=self.generator)
        for row, seed in seeds.items():
            keys[row] = as_int64(seed)
        return keys
