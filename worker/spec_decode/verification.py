"""Checking drafts: the longest prefix the model agrees with, plus one token of its own.

Every checked position is a sampling row that samples exactly as the request would
without speculation at that output index (worker.input_batch: the same parameters,
penalties over the tokens before it, and a seeded request's noise for that index).
Draft i is accepted while the row before it sampled it; the first row that
disagrees gives its own sample, and when all agree the last row gives a bonus token.

Drafts are proposed deterministically (prompt lookup; a draft model's argmax), so
the proposal q is one token with probability 1. Speculative sampling's rule for
that q accepts draft x with probability min(1, p(x)/q(x)) = p(x) and otherwise
samples from the residual max(0, p - q) normalized, which is p without x: exactly
what comparing a sample from p with x does (it equals x with probability p(x), and
otherwise is distributed as p without x). So every output token is distributed as
the model's, greedy outputs equal plain decoding's, and a seeded request gives the
same tokens with or without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import TokenLogprobs


@dataclass(slots=True)
class Verified:
    tokens: list[int]  # per sampling request: its last new token (a rejected draft's replacement, or the bonus)
    accepted: list[list[int]]  # per sampling request: the drafts accepted before it
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per request: its last token's
    draft_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # per request: accepted drafts'


def verify(drafts: list[list[int]], row_tokens: list[int],
           row_logprobs: list[TokenLogprobs | None] | None = None) -> Verified:
    """`row_tokens`: each row's sample, the rows of request i being 1 + len(drafts[i])
    consecutive entries; `row_logprobs` likewise (None: no row asked)."""
    expected = sum(len(d) + 1 for d in drafts)
    if len(row_tokens) != expected:
        raise ValueError(f"{len(row_tokens)} sampled rows for {expected} checked positions")
    result = Verified([], [])
    row = 0
    for d in drafts:
        accepted = 0
        while accepted < len(d) and row_tokens[row + accepted] == d[accepted]:
            accepted += 1
        result.accepted.append(list(d[:accepted]))
        result.tokens.append(row_tokens[row + accepted])
        if row_logprobs is not None:
            entries = row_logprobs[row:row + accepted + 1]
            result.logprobs.append(entries[-1])
            result.draft_logprobs.append([e for e in entries[:-1] if e is not None])
        row += len(d) + 1
    return result
