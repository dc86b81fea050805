"""The Responses API's output logprobs (`include: ["message.output_text.logprobs"]`
with `top_logprobs`), as vLLM serves them: on the message's output_text, whole,
and streamed on each output_text delta (adding up to the done event's and the
final response's); none unless asked for. The fake model reports -0.5 for
every token, its only alternative itself."""
from __future__ import annotations

import openai
import pytest

INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def as_dicts(logprobs) -> list[dict]:
    return [entry.to_dict() for entry in logprobs]


def test_whole_and_streamed_logprobs_agree(client, server):
    request = dict(model="tiny-model", input="Say hello", max_output_tokens=6, include=INCLUDE, top_logprobs=1)
    whole = client.responses.create(**request)
    [part] = whole.output[0].content
    assert len(part.logprobs) == 6 and whole.top_logprobs == 1
    assert "".join(entry.token for entry in part.logprobs) == part.text == whole.output_text
    assert all(entry.logprob == -0.5 and [top.token for top in entry.top_logprobs] == [entry.token]
               for entry in part.logprobs)
    assert all(bytes(entry.bytes).decode() == entry.token for entry in part.logprobs)

    events = list(client.responses.create(**request, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert [d for e in deltas for d in as_dicts(e.logprobs)] == as_dicts(done.logprobs) == \
        as_dicts(final.output[0].content[0].logprobs) == as_dicts(part.logprobs)
    assert all(len(e.logprobs) >= 1 for e in deltas)  # each delta carries its own tokens' logprobs


def test_no_logprobs_unless_included(client):
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=4, top_logprobs=3)
    assert response.output[0].content[0].logprobs == [] and response.top_logprobs == 3
    events = list(client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=4, stream=True))
    assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")


def test_zero_top_logprobs_gives_the_chosen_tokens_only(client):
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=3, include=INCLUDE)
    assert [entry.top_logprobs for entry in response.output[0].content[0].logprobs] == [[], [], []]


@pytest.mark.parametrize("request_fields, param", [
    ({"include": INCLUDE + ["reasoning.encrypted_content"]}, "include"),
    ({"include": INCLUDE, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs")])
def test_what_cannot_be_served_is_a_400(client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny-model", input="Hi", max_output_tokens=2, **request_fields)
    assert refused.value.body["param"] == param


def test_a_plain_reply_with_tools_streams_its_logprobs(tool_stack):
    # With "auto" tools the stream cannot tell early whether text is the message; text that
    # goes out as the message still carries its logprobs, as vLLM streams them.
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    request = dict(model="tiny-model", input="Say hello", tools=tools, include=INCLUDE, top_logprobs=1)
    with tool_stack.replying("Just some words, no call at all."):
        whole = tool_stack.client.responses.create(**request)
        events = list(tool_stack.client.responses.create(**request, stream=True))
    expected = as_dicts(whole.output[0].content[0].logprobs)
    deltas = [d for e in events if e.type == "response.output_text.delta" for d in as_dicts(e.logprobs)]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    # The final EOS shows no text: its logprob is on the done event, not on a delta.
    assert len(deltas) == len(expected) - 1 > 0 and deltas == expected[:-1]
    assert as_dicts(done.logprobs) == expected
    assert as_dicts(events[-1].response.output[0].content[0].logprobs) == expected


def test_a_reply_with_calls_streams_the_logprobs_of_its_text_only(tool_stack):
    tools = [{"type": "function", "name": name, "parameters": {"type": "object"}}
             for name in ("get_weather", "get_time")]
    events = list(tool_stack.client.responses.create(model="tiny-model", input="Weather and time?", tools=tools,
                                                     include=INCLUDE, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    assert "".join(e.delta for e in deltas) == final.output[0].content[0].text == "Let me check both. "
    assert [d for e in deltas for d in as_dicts(e.logprobs)] == as_dicts(final.output[0].content[0].logprobs) != []
