"""Logit adjustments applied before sampling, vectorized over the batch.

In vLLM's order: the structured-output grammar masks, allowed_token_ids
(every other token masked), bad_words (a one-token word is always masked, a
longer one's last token right after the rest of it was generated), min_tokens
(EOS and stop token ids cannot be sampled before `min_tokens` outputs), logit_bias,
then the penalties (repetition, frequency and presence; see `worker.penalties`).

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
from worker.penalties import Penalties
from worker.structured_output import GrammarMasks, GrammarMatcher, grammar_masks


@dataclass(slots=True)
class LogitsAdjustments:
    """Everything one step adjusts, as sparse (row, token) lists and per-row tensors."""

    banned: tuple[list[int], list[int]] | None  # (rows, token ids) set to -inf (min_tokens, bad_words)
    bias: tuple[list[int], list[int], list[float]] | None  # (rows, token ids, biases)
    penalties: Penalties | None
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
        masks = grammar_masks(grammars) if grammars is not None else None
        penalties = Penalties.build(params, token_ids, num_prompt_tokens, device)
        if not (banned_rows or bias_rows or penalties or masks or allowed_rows):
            return None
        return cls(banned=(banned_rows, banned_tokens) if banned_rows else None,
                   bias=(bias_rows, bias_tokens, biases) if bias_rows else None,
                   penalties=penalties,
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
            self.penalties.apply(logits)
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


def _in_vocab(vocab: int, rows: list[int], tokens: list[int], *extra: list) -> tuple[list, ...]:
    if all(0 <= t < vocab for t in tokens):
        return (rows, tokens, *extra)
    keep = [i for i, t in enumerate(tokens) if 0 <= t < vocab]
    return tuple([values[i] for i in keep] for values in (rows, tokens, *extra))


def _tensor(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)
