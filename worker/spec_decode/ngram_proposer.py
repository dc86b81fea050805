"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence
of the sequence's last n tokens, for the longest n from prompt_lookup_max down to
prompt_lookup_min that occurs (vLLM's `ngram` method). Free to run and right most
often where the output copies the prompt: edits, summaries, answers quoting a context."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.speculative_config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_one(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k drafts to follow `token_ids` (none when no n-gram recurs)."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = tokens.shape[0]
        if length < self.min_n + 1 or k <= 0:
            return []
        # Candidate ends: earlier positions holding the last token (never the last position itself).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        matched = np.ones(ends.shape[0], dtype=np.int64)
        alive = np.ones(ends.shape[0], dtype=bool)
        for back in range(1, self.max_n):
            before = ends - back
            ok = alive & (before >= 0)
            ok[ok] = tokens[before[ok]] == tokens[length - 1 - back]
            matched += ok
            alive = ok
            if not alive.any():
                break
        best = int(matched.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest matches
        return tokens[end + 1:end + 1 + k].tolist()

    def propose(self, sequences: Sequence[Sequence[int]], limits: Sequence[int] | None = None) -> list[list[int]]:
        return [self.propose_one(tokens, None if limits is None else limits[i]) for i, tokens in enumerate(sequences)]
