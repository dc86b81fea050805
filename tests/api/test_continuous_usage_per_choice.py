"""Continuous usage stats with n > 1, as vLLM reports them: each chunk's
completion_tokens are its own choice's tokens so far; the final usage chunk
sums every choice."""
from __future__ import annotations

from collections import defaultdict

from serve_helpers import MODEL

OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def per_choice_counts(chunks) -> dict[int, list[int]]:
    counts: dict[int, list[int]] = defaultdict(list)
    for chunk in chunks:
        if chunk.choices:
            counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    return counts


def test_chat_continuous_usage_is_per_choice(client):
    *chunks, last = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, seed=1, stream=True,
        extra_body={"ignore_eos": True}, stream_options=OPTIONS)
    counts = per_choice_counts(chunks)
    assert counts[0][0] == counts[1][0] == 0  # the role chunks
    assert counts[0][-1] == counts[1][-1] == 4
    assert last.choices == [] and last.usage.completion_tokens == 8


def test_completions_continuous_usage_is_per_choice(client):
    *chunks, last = client.completions.create(
        model=MODEL, prompt=["Hi", "Hello there"], max_tokens=3, n=2, seed=1, stream=True,
        extra_body={"ignore_eos": True}, stream_options=OPTIONS)
    counts = per_choice_counts(chunks)
    assert sorted(counts) == [0, 1, 2, 3] and all(values[-1] == 3 for values in counts.values())
    assert all(values == sorted(values) for values in counts.values())
    assert last.choices == [] and last.usage.completion_tokens == 12
