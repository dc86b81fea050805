"""Logit adjustments applied before sampling, vectorized over the batch.

In vLLM's order: the structured-output grammar masks, allowed_token_ids
(every other token masked), bad_words (a one-token word is always masked, a
longer one's last token right after the rest of it was generated), min_tokens
(EOS and stop token ids cannot be sampled before `min_tokens` outputs), logit_bias,
then the penalties: repetition (over the prompt and the output, exactly
transformers' RepetitionPenaltyLogitsProcessor), frequency and presence (over
the output, as OpenAI documents them: logit - frequency * count - presence *
[count > 0]).

Each adjustment only exists when some row of the step uses it, so a step
without any of them builds nothing and leaves the logits untouched. Token ids
outside the vocabulary are ignored (the frontend rejects them; the worker
must not crash on them).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from worker.structured_output import GrammarMasks, GrammarMatcher, grammar_masks


@dataclass(slots=True)
class _Penalties:
    rows: torch.Tensor  # [P] int64 rows that use a penalty
    prompt_ids: list[list[int]]  # per penalized row
    output_ids: list[list[int]]
    repetition: torch.Tensor | None  # [P] float32, 1 = off
    frequency: torch.Tensor | None  # [P] float32, 0 = off
    presence: torch.Tensor | None


@dataclass(slots=True)
class LogitsAdjustments:
    """Everything one step adjusts, as sparse (row, token) lists and per-row tensors."""

    banned: tuple[list[int], list[int]] | None  # (rows, token ids) set to -inf (min_tokens, bad_words)
    bias: tuple[list[int], list[int], list[float]] | None  # (rows, token ids, biases)
    penalties: _Penalties | None
    grammar: GrammarMasks | None = None  # rows whose structured output constrains the next token
    allowed: tuple[list[int], list[list[int]]] | None = None  # (rows, each row's allowed_token_ids)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
              num_prompt_tokens: Sequence[int], eos_token_ids: Sequence[int] = (),
              device: torch.device | str = "cpu",
              grammars: Sequence[GrammarMatcher | None] | None = None) -> "LogitsAdjustments | None":
        """`token_ids[row]`: the row's prompt then its outputs so far;
        `grammars[row]`: its structured-output matcher, if any. None when no
        row adjusts anything."""
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        biases: list[float] = []
        penalized: list[int] = []
        allowed_rows: list[int] = []
        for row, p in enumerate(params):
            num_outputs = len(token_ids[row]) - num_prompt_tokens[row]
            if p.allowed_token_ids:
                allowed_rows.append(row)
            if p.bad_words_token_ids:
                bans = bad_word_bans(p.bad_words_token_ids, token_ids[row], num_outputs)
                banned_rows += [row] * len(bans)
                banned_tokens += bans
            if num_outputs < p.min_tokens:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stops.update(eos_token_ids)
                banned_rows += [row] * len(stops)
                banned_tokens += stops
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_tokens += p.logit_bias.keys()
                biases += p.logit_bias.values()
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                penalized.append(row)
        masks = grammar_masks(grammars) if grammars is not None else None
        if not (banned_rows or bias_rows or penalized or masks or allowed_rows):
            return None
        return cls(banned=(banned_rows, banned_tokens) if banned_rows else None,
                   bias=(bias_rows, bias_tokens, biases) if bias_rows else None,
                   penalties=_build_penalties(penalized, params, token_ids, num_prompt_tokens, device),
                   grammar=masks,
                   allowed=(allowed_rows, [params[row].allowed_token_ids for row in allowed_rows])
                   if allowed_rows else None)

    def rows(self) -> set[int]:
        """The rows whose logits this changes."""
        rows = set(self.banned[0]) if self.banned is not None else set()
        if self.bias is not None:
            rows.update(self.bias[0])
        if self.penalties is not None:
            rows.update(self.penalties.rows.tolist())
        if self.grammar is not None:
            rows.update(self.grammar.rows)
        if self.allowed is not None:
            rows.update(self.allowed[0])
        return rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjust float32 logits [N, vocab] in place; returns them."""
        vocab = logits.shape[1]
        if self.grammar is not None:
            self.grammar.apply(logits)
        if self.allowed is not None:
            rows = _tensor(self.allowed[0], logits)
            allowed = token_mask(self.allowed[1], vocab, logits.device)
            logits[rows] = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        if self.banned is not None:
            rows, tokens = _in_vocab(vocab, *self.banned)
            logits[_tensor(rows, logits), _tensor(tokens, logits)] = float("-inf")
        if self.bias is not None:
            rows, tokens, biases = _in_vocab(vocab, *self.bias)
            logits.index_put_((_tensor(rows, logits), _tensor(tokens, logits)),
                              torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)
        if self.penalties is not None:
            pen = self.penalties
            sub = logits.index_select(0, pen.rows)
            if pen.repetition is not None:
                seen = token_mask(pen.prompt_ids, vocab, sub.device) | token_mask(pen.output_ids, vocab, sub.device)
                sub = apply_repetition_penalty(sub, seen, pen.repetition)
            if pen.frequency is not None:
                sub = apply_frequency_presence_penalties(sub, token_counts(pen.output_ids, vocab, sub.device),
                                                         pen.frequency, pen.presence)
            logits[pen.rows] = sub
        return logits


def bad_word_bans(bad_words: Sequence[Sequence[int]], token_ids: Sequence[int], num_outputs: int) -> list[int]:
    """The tokens bad_words forbid next: each word's last token, when the output so far
    ends with the rest of the word (always, for a one-token word). As vLLM, only the
    output counts: a word begun at the end of the prompt is not completed by it."""
    bans = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= num_outputs and list(token_ids[len(token_ids) - prefix:]) == list(word[:-1])):
            bans.append(word[-1])
    return bans


def _build_penalties(rows: list[int], params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
                     num_prompt_tokens: Sequence[int], device) -> _Penalties | None:
    if not rows:
        return None
    chosen = [params[row] for row in rows]
    repetition = [float(p.repetition_penalty) for p in chosen]
    frequency = [float(p.frequency_penalty) for p in chosen]
    presence = [float(p.presence_penalty) for p in chosen]
    use_frequency_presence = any(frequency) or any(presence)

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return _Penalties(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        prompt_ids=[list(token_ids[row][:num_prompt_tokens[row]]) for row in rows],
        output_ids=[list(token_ids[row][num_prompt_tokens[row]:]) for row in rows],
        repetition=floats(repetition) if any(r != 1.0 for r in repetition) else None,
        frequency=floats(frequency) if use_frequency_presence else None,
        presence=floats(presence) if use_frequency_presence else None)


def token_counts(token_ids: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[R, vocab] float32: how often each token occurs in each row's list
    (ids outside the vocabulary are dropped)."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Padding and out-of-range ids land in an extra column that is cut off.
    padded = torch.full((len(token_ids), width), vocab, dtype=torch.int64, device=device)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64, device=device)
    padded.masked_fill_((padded < 0) | (padded > vocab), vocab)
    counts = torch.zeros((len(token_ids), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def token_mask(token_ids: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[R, vocab] bool: which tokens occur in each row's list."""
    return token_counts(token_ids, vocab, device) > 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' rule for every seen token: negative logits are multiplied
    by the penalty, the others divided by it."""
    penalty = penalty.unsqueeze(1)
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                                       presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's formula: logit - frequency * count - presence * [count > 0]."""
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _in_vocab(vocab: int, rows: list[int], tokens: list[int], *extra: list) -> tuple[list, ...]:
    if all(0 <= t < vocab for t in tokens):
        return (rows, tokens, *extra)
    keep = [i for i, t in enumerate(tokens) if 0 <= t < vocab]
    return tuple([values[i] for i in keep] for values in (rows, tokens, *extra))


def _tensor(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)
