"""vLLM's beam search written out plainly, as the tests' reference: no early
stop, candidates from each beam's top 2 * beam_width tokens by logprob, EOS
candidates finished, the rest ranked by score (cumulative logprob / length **
length_penalty, the length counting the prompt and not a final EOS).

`next_logprobs(sequence)` gives the model's log-softmax over the vocabulary
after `sequence` (a list of floats)."""
from __future__ import annotations

from typing import Callable


def reference_beam_search(next_logprobs: Callable[[list[int]], list[float]], prompt: list[int], beam_width: int,
                          max_tokens: int, eos: set[int], length_penalty: float = 1.0,
                          ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """The best sequences as (output tokens, final EOS included; cumulative logprob), best first."""
    def score(tokens: list[int], cumulative: float, by_eos: bool) -> float:
        return cumulative / ((len(prompt) + len(tokens) - by_eos) ** length_penalty)

    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cumulative in live:
            logprobs = next_logprobs(prompt + tokens)
            top = sorted(range(len(logprobs)), key=lambda t: (-logprobs[t], t))[:2 * beam_width]
            for token in top:
                new = (tokens + [token], cumulative + logprobs[token])
                if token in eos and not ignore_eos:
                    done.append((*new, True))
                else:
                    candidates.append(new)
        candidates.sort(key=lambda c: score(c[0], c[1], False), reverse=True)
        live = candidates[:beam_width]
        if not live:
            break
    ranked = sorted(done + [(tokens, cumulative, False) for tokens, cumulative in live],
                    key=lambda c: score(*c), reverse=True)
    return [(tokens, cumulative) for tokens, cumulative, _ in ranked[:beam_width]]
