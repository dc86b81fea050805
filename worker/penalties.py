"""Repetition, frequency and presence penalties on the (row, token) pairs they touch.

Repetition (over the prompt and the output, exactly transformers'
RepetitionPenaltyLogitsProcessor): a seen token's negative logit is multiplied
by the penalty, any other divided by it. Frequency and presence (over the
output, as OpenAI documents them): logit - frequency * count - presence *
[count > 0], after the repetition penalty.

A row only ever sees a few hundred distinct tokens, so the penalties gather,
adjust and write back just those logits instead of building counts and masks
over the whole [rows, vocab] block, which costs a full pass over it. The arithmetic per logit is the same elementwise float32 ops either way.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling_params import SamplingParams

_TOKEN_BITS = 32  # a (row, token) pair packs into one int64 key: row << 32 | token


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [P] int64: the batch rows that use a penalty
    pair_rows: torch.Tensor  # [U] int64: the batch row of each distinct (row, token) pair
    pair_tokens: torch.Tensor  # [U] int64
    output_counts: torch.Tensor  # [U] float32: how often the token occurs in the row's output
    repetition: torch.Tensor | None  # [U] float32 (the pair's row's penalty); None: no row uses it
    frequency: torch.Tensor | None  # [U] float32; None (with presence): no row uses either
    presence: torch.Tensor | None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
              num_prompt_tokens: Sequence[int], device: torch.device | str = "cpu") -> "Penalties | None":
        """`token_ids[row]`: the row's prompt then its outputs so far. None when no row is penalized."""
        rows = [row for row, p in enumerate(params)
                if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
        if not rows:
            return None
        lengths = np.array([len(token_ids[row]) for row in rows], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(token_ids[row] for row in rows), dtype=np.int64,
                           count=int(lengths.sum()))
        owner = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)  # index into `rows`
        position = np.arange(flat.size, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        is_output = position >= np.repeat(np.array([num_prompt_tokens[row] for row in rows]), lengths)
        valid = (flat >= 0) & (flat < 1 << (_TOKEN_BITS - 1))  # the rest cannot be a token (nor is it in a vocabulary)
        keys, inverse = np.unique((owner << _TOKEN_BITS | flat)[valid], return_inverse=True)
        counts = np.bincount(inverse, weights=is_output[valid], minlength=keys.size)
        owners = keys >> _TOKEN_BITS
        chosen = [params[row] for row in rows]
        repetition = np.array([p.repetition_penalty for p in chosen], dtype=np.float32)
        frequency = np.array([p.frequency_penalty for p in chosen], dtype=np.float32)
        presence = np.array([p.presence_penalty for p in chosen], dtype=np.float32)
        use_frequency_presence = bool(frequency.any() or presence.any())

        def per_pair(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values[owners]).to(device)

        return cls(rows=torch.tensor(rows, dtype=torch.int64, device=device),
                   pair_rows=torch.from_numpy(np.array(rows, dtype=np.int64)[owners]).to(device),
                   pair_tokens=torch.from_numpy(keys & ((1 << _TOKEN_BITS) - 1)).to(device),
                   output_counts=torch.from_numpy(counts.astype(np.float32)).to(device),
                   repetition=per_pair(repetition) if (repetition != 1.0).any() else None,
                   frequency=per_pair(frequency) if use_frequency_presence else None,
                   presence=per_pair(presence) if use_frequency_presence else None)

    def apply(self, logits: torch.Tensor) -> None:
        """Penalize float32 logits [N, vocab] in place (pairs outside the vocabulary are skipped)."""
        keep = self.pair_tokens < logits.shape[1]
        rows, tokens = self.pair_rows[keep], self.pair_tokens[keep]
        values = logits[rows, tokens]
        if self.repetition is not None:
            penalty = self.repetition[keep]
            values = torch.where(values < 0, values * penalty, values / penalty)
        if self.frequency is not None and self.presence is not None:
            counts = self.output_counts[keep]
            values = values - self.frequency[keep] * counts - self.presence[keep] * (counts > 0).to(values.dtype)
        logits[rows, tokens] = values  # the pairs are distinct: one write each
