"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, seeds.

Everything is done on [N, vocab] tensors; no Python loop ever touches the
vocabulary. Random rows are sampled with the exponential race: for
probabilities p and independent E_i ~ Exp(1), argmax(p_i / E_i) is distributed
exactly as p. That turns sampling into one elementwise op and an argmax, and
lets each seeded request own its noise, so its output does not depend on
which other requests share the batch.

Filter order follows vLLM: temperature, then min-p, top-k, and last top-p on
the distribution the earlier filters left (renormalized). Before all of them
the logits adjustments (min_tokens, logit_bias, penalties; see
`worker.logits_processors`) apply to greedy and random rows alike, and
requested logprobs are taken from the raw logits, before any adjustment.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.protocol import TokenLogprobs
from common.sampling_params import SamplingParams
from worker.logits_processors import LogitsAdjustments
from worker.logprobs import select_logprobs
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
    argmax for bfloat16 rows (5.7 ms against 1.5 ms for 64 x 49152)."""
    return logits.max(dim=-1).indices


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: list[TokenLogprobs | None] | None  # per row, for the rows that asked; None: no row asked


class Sampler:
    """Picks one token per row of float32 logits [N, vocab]."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        # Noise for unseeded rows: reproducible per engine seed, shared batch draw.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed & _MASK_64)
        # Re-seeded for every seeded row, so one object serves all requests.
        self.seeded_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sampled token ids [N] int64 (the logits may be adjusted in place)."""
        return self.sample(logits, meta).token_ids

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               refine_greedy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        """Sampled token ids, and the logprobs the rows asked for. `refine_greedy(logits,
        rows)`, given for reduced-precision models, re-picks the greedy rows whose logits
        nothing adjusts (see worker.greedy_refine)."""
        if logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, sampling metadata {meta.num_rows}")
        wanted = meta.num_logprobs
        raw_logprobs = rows = None
        if wanted is not None:  # from the raw logits, before the adjustments change them
            rows = [row for row, k in enumerate(wanted) if k is not None]
            raw_logprobs = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
            raw_logprobs = raw_logprobs.log_softmax(dim=-1)
        if meta.adjustments is not None:
            logits = meta.adjustments.apply(logits)
        rows_to_refine = meta.unadjusted_greedy_rows() if refine_greedy is not None else []
        if refine_greedy is not None and len(rows_to_refine) == meta.num_rows:
            # Every row plain greedy: the refiner's own argmax is the whole sampling.
            token_ids = refine_greedy(logits, torch.arange(meta.num_rows, device=logits.device))
        else:
            token_ids = self._sample(logits, meta)
            if rows_to_refine:
                index = torch.tensor(rows_to_refine, device=token_ids.device)
                token_ids[index] = refine_greedy(logits, index)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None)
        chosen = token_ids.index_select(0, torch.tensor(rows, device=token_ids.device))
        selected = select_logprobs(raw_logprobs, chosen, [wanted[row] for row in rows])
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
        logits = logits.float() / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        # The race only compares within a row, so unnormalized probabilities
        # exp(l - max) do (no softmax sum/divide). With E = -log(U), U in [0, 1):
        # argmax(p / E) = argmin(p / log U), which saves negating the noise.
        # U = 0 gives p / -inf = -0.0, the largest possible value: never picked.
        scores = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        return scores.div_(self._uniform_noise(scores, meta.seeds).log_()).argmin(dim=-1)

    def _uniform_noise(self, like: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
        """U ~ Uniform[0, 1) shaped like `like` (cheaper on CPU than exponential_)."""
        noise = torch.empty_like(like)
        if not seeds:
            return noise.uniform_(generator=self.generator)
        # Seeded rows draw their own noise (independent of the batch); all
        # other rows share one draw from the engine generator.
        for row, seed in seeds.items():
            self.seeded_generator.manual_seed(seed)
            noise[row].uniform_(generator=self.seeded_generator)
        unseeded = [row for row in range(like.shape[0]) if row not in seeds]
        if unseeded:
            shared = torch.empty((len(unseeded), like.shape[1]), dtype=like.dtype, device=like.device)
            shared.uniform_(generator=self.generator)
            noise[torch.tensor(unseeded, device=like.device)] = shared
        return noise


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the top probability.

    p_i < m * p_max  <=>  logit_i < logit_max + log(m), so no softmax is needed;
    rows with min_p = 0 get a threshold of -inf and keep everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k most likely tokens (top_k 0 = all), then the smallest
    prefix of those, by descending probability, whose mass reaches top_p.

    Only the rows that use a filter are touched. Full-vocabulary sorts are
    slow on CPU, so the work happens on each row's TOP_P_CANDIDATES largest
    logits whenever the answer provably lies among them (see
    `_top_k_top_p_candidates`); only the remaining rows are sorted.
    """
    rows = _active_rows(top_k, top_p)
    if rows.numel() == 0:
        return logits
    every_row = rows.numel() == logits.shape[0]
    sub = logits if every_row else logits.index_select(0, rows)
    vocab = sub.shape[1]
    k = torch.full((rows.numel(),), vocab, dtype=torch.int64, device=logits.device)
    if top_k is not None:
        row_k = top_k.index_select(0, rows)
        k = torch.where(row_k > 0, row_k.clamp(max=vocab), k)
    if top_p is None:
        kth_largest = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        sub = sub.masked_fill(sub < kth_largest, float("-inf"))
    else:
        sub = _top_k_top_p(sub, k, top_p.index_select(0, rows))
    if every_row:
        return sub
    out = logits.clone()
    out[rows] = sub
    return out


TOP_P_CANDIDATES = 256


def _active_rows(top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    active = None
    if top_k is not None:
        active = top_k > 0
    if top_p is not None:
        active = (top_p < 1.0) if active is None else active | (top_p < 1.0)
    assert active is not None
    return active.nonzero().squeeze(1)


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """k: [R] in [1, vocab] (vocab = no top-k); p: [R]."""
    solved, out = _top_k_top_p_candidates(logits, k, p)
    unsolved = (~solved).nonzero().squeeze(1)
    if unsolved.numel():
        out[unsolved] = _top_k_top_p_sorted(logits.index_select(0, unsolved), k[unsolved], p[unsolved])
    return out


def _top_k_top_p_candidates(logits: torch.Tensor, k: torch.Tensor,
                            p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p over the C largest logits of each row (already sorted by topk).

    Exact for a row when (a) k <= C: all of top-k is among the candidates, or
    (b) top-k is off and the candidates' mass reaches p: every later token
    then has mass_before >= p and is dropped anyway. Returns (solved rows,
    filtered logits valid on those rows).
    """
    vocab = logits.shape[1]
    num_candidates = min(TOP_P_CANDIDATES, vocab)
    values, indices = logits.topk(num_candidates, dim=-1)
    ranks = torch.arange(num_candidates, device=logits.device)
    values = values.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
    top_k_within = k <= num_candidates
    # Probabilities under the top-k-renormalized distribution: its normalizer
    # is over the candidates when top-k fits there, else over the whole row.
    normalizer = torch.where(top_k_within, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - normalizer.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    solved = top_k_within | ((k == vocab) & (cumulative[:, -1] >= p))
    values = values.masked_fill((cumulative - probs >= p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(1, indices, values)
    return solved, out


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token: a token is kept while that is < p, so
    # the kept set is the smallest prefix reaching p. The most likely token
    # always stays, even for a p that float32 rounds to 0.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
