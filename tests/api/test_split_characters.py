"""A reply cut by max_tokens inside a multi-byte character (SmolLM2 spells
each emoji with several byte-level tokens) ends before that character, as
vLLM's does: no trailing U+FFFD, streamed or not."""
from __future__ import annotations

import openai

from serve_helpers import MODEL

PROMPT = "Emoji list: 🙂 😀 🎉 🚀 🐍 🙂 😀 🎉 🚀"


def complete(client: openai.OpenAI, max_tokens: int, stream: bool = False):
    return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=max_tokens,
                                     logprobs=0, stream=stream)


def test_a_reply_cut_inside_a_character_ends_before_it(client):
    longest = complete(client, 8).choices[0]
    assert "🐍" in longest.text or "😀" in longest.text  # the model goes on with emoji (greedy, float32)
    cut_inside = 0
    for max_tokens in range(1, 5):
        choice = complete(client, max_tokens).choices[0]
        streamed = "".join(chunk.choices[0].text for chunk in complete(client, max_tokens, stream=True))
        assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == max_tokens
        assert "\ufffd" not in choice.text and streamed == choice.text
        assert longest.text.startswith(choice.text)
        # The last token holds only some bytes of a character: its own text is U+FFFD.
        cut_inside += choice.logprobs.tokens[-1].endswith("\ufffd")
    assert cut_inside > 0  # the case under test happened
