"""`use_beam_search` through the real process split and the `openai` client:
the choices are the reference search's best sequences (`beam_search_reference`,
on transformers' float32 log-softmax of SmolLM2), best first; chat streamed
gives the whole reply's choices; fields beam search cannot honour are a 400."""
from __future__ import annotations

import openai
import pytest

from beam_search_reference import reference_beam_search
from serve_helpers import MODEL

BEAMS = {"use_beam_search": True, "return_token_ids": True}


def score(prompt: list[int], tokens: list[int], cumulative: float) -> float:
    return cumulative / (len(prompt) + len(tokens))


def test_completion_choices_are_the_reference_searchs_best(client, reference, tokenizer):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", n=3, max_tokens=5,
                                         extra_body={**BEAMS, "ignore_eos": True})
    prompt = response.choices[0].prompt_token_ids
    expected = reference_beam_search(lambda s: reference.logprobs(s)[-1].tolist(), prompt, 3, 5,
                                     {tokenizer.eos_token_id}, ignore_eos=True)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    got = [choice.token_ids for choice in response.choices]
    assert len({tuple(tokens) for tokens in got}) == 3
    cumulative = [sum(reference.logprobs(prompt + tokens[:i])[-1][t].item() for i, t in enumerate(tokens))
                  for tokens in got]
    assert [score(prompt, tokens, c) for tokens, c in zip(got, cumulative)] == pytest.approx(
        [score(prompt, tokens, c) for tokens, c in expected], abs=1e-4)
    assert [choice.text for choice in response.choices] == [tokenizer.decode(tokens) for tokens in got]
    assert response.usage.completion_tokens == 15 and all(c.finish_reason == "length" for c in response.choices)


def test_chat_streamed_is_the_whole_reply(client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=2, max_tokens=6,
                   extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    for choice in whole.choices:
        streamed = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == choice.index)
        assert streamed == choice.message.content
        assert [c.finish_reason for chunk in chunks for c in chunk.choices
                if c.index == choice.index and c.finish_reason] == [choice.finish_reason]
    assert whole.choices[0].message.content != whole.choices[1].message.content


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"), ({"n": 11}, "n"), ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"guided_regex": "a+"}, "guided_regex"), ({"max_tokens": 0}, "max_tokens")])
def test_what_beam_search_cannot_honour_is_a_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"max_tokens": 3, **BEAMS, **fields})
    assert refused.value.body["param"] == param
