"""Streamed tool calls, as vLLM streams them, read with the `openai` client from
a frontend in front of a fake model (`tool_stack.py`): each call's header
(index, id, type, name) once, then its arguments in pieces whose concatenation
is the non-stream reply's arguments; the finish reason of the non-stream reply.
The fake model writes its script whatever the tool choice (no grammar), so a
script stands for what the grammar of a named function or "required" makes."""
from __future__ import annotations

import json

import pytest

from tests.frontend.tool_stack import ASK, REPLY, TOOLS
from tool_stream_helpers import finish_reason, streamed_calls, streamed_content

NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
REQUIRED_REPLY = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                  '{"name": "get_time", "parameters": {"timezone": "CET"}}]')


def stream(client, **request) -> list:
    return [chunk for chunk in client.chat.completions.create(**{"model": "tiny-model", "messages": ASK,
                                                                 "tools": TOOLS, "stream": True, **request})
            if chunk.choices]


def whole(client, **request):
    return client.chat.completions.create(**{"model": "tiny-model", "messages": ASK, "tools": TOOLS,
                                             **request}).choices[0]


@pytest.mark.parametrize("tool_choice, reply", [("auto", REPLY), ("required", REQUIRED_REPLY),
                                                (NAMED, WEATHER_ARGUMENTS)], ids=["auto", "required", "named"])
def test_calls_stream_argument_by_argument_and_add_up_to_the_whole_reply(tool_stack, tool_choice, reply):
    with tool_stack.replying(reply):
        expected = whole(tool_stack.client, tool_choice=tool_choice)
        chunks = stream(tool_stack.client, tool_choice=tool_choice)
    calls = streamed_calls(chunks)
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in expected.message.tool_calls]
    assert all(len(call.fragments) > 1 for call in calls)  # the arguments came in pieces, not whole
    assert all(call.id.startswith("chatcmpl-tool-") for call in calls) and len({c.id for c in calls}) == len(calls)
    assert finish_reason(chunks) == expected.finish_reason == ("stop" if tool_choice is NAMED else "tool_calls")
    assert streamed_content(chunks) == (expected.message.content or "")
    # The name goes out before any of the arguments: in the call's first delta.
    first = next(d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or [])
    assert first.function.name == calls[0].name and len(first.function.arguments or "") < len(calls[0].arguments)


def test_the_arguments_are_the_model_text_equal_as_json_to_the_whole_reply(tool_stack):
    # The non-stream reply re-serialises "required" parameters; the stream sends them as written.
    compact = '[{"name":"get_time","parameters":{"timezone":"CET"}}]'
    with tool_stack.replying(compact):
        [expected] = whole(tool_stack.client, tool_choice="required").message.tool_calls
        [call] = streamed_calls(stream(tool_stack.client, tool_choice="required"))
    assert call.arguments == '{"timezone":"CET"}' and expected.function.arguments == '{"timezone": "CET"}'


def test_the_openai_stream_helper_gets_the_calls_piece_by_piece(tool_stack):
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    expected = whole(tool_stack.client, tools=strict)
    with tool_stack.client.chat.completions.stream(model="tiny-model", messages=ASK, tools=strict) as events:
        kinds = [(event.type, getattr(event, "index", None)) for event in events]
        final = events.get_final_completion().choices[0]
    assert kinds.count(("tool_calls.function.arguments.delta", 0)) > 1
    assert kinds.count(("tool_calls.function.arguments.done", 0)) == 1
    assert kinds.count(("tool_calls.function.arguments.done", 1)) == 1
    assert [(c.function.name, c.function.parsed_arguments) for c in final.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected.message.tool_calls]
    assert final.finish_reason == "tool_calls" and final.message.content == expected.message.content


def test_each_choice_numbers_its_calls_from_zero(tool_stack):
    chunks = stream(tool_stack.client, n=2)
    choices = [streamed_calls(chunks, choice) for choice in (0, 1)]
    assert [[(c.index, c.name, c.arguments) for c in calls] for calls in choices] == [
        [(0, "get_weather", '{"city": "Paris"}'), (1, "get_time", '{"timezone": "CET"}')]] * 2
    assert len({call.id for calls in choices for call in calls}) == 4
    assert [finish_reason(chunks, choice) for choice in (0, 1)] == ["tool_calls"] * 2


def test_logprobs_usage_and_prompt_logprobs_still_come_with_the_calls(tool_stack):
    expected = tool_stack.client.chat.completions.create(model="tiny-model", messages=ASK, tools=TOOLS,
                                                         logprobs=True)
    chunks = list(tool_stack.client.chat.completions.create(
        model="tiny-model", messages=ASK, tools=TOOLS, logprobs=True, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"prompt_logprobs": 0}))
    streamed = [entry for chunk in chunks for c in chunk.choices for entry in (c.logprobs.content if c.logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in expected.choices[0].logprobs.content]
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    assert sum(1 for chunk in chunks if getattr(chunk, "prompt_logprobs", None)) == 1
    assert [c.name for c in streamed_calls([c for c in chunks if c.choices])] == ["get_weather", "get_time"]


def test_a_reply_cut_by_max_tokens_mid_call_keeps_what_was_streamed(tool_stack):
    # Cut inside the second call's arguments: the stream has sent the first call
    # whole and the second one's start (vLLM does the same), with finish reason
    # "length"; the non-stream reply, which cannot parse the cut call, is text.
    tokens = tool_stack.tokenizer.encode(REPLY)
    cut = next(n for n in range(len(tokens)) if '"timezone": "' in tool_stack.tokenizer.decode(tokens[:n]))
    chunks = stream(tool_stack.client, max_tokens=cut)
    first, second = streamed_calls(chunks)
    assert (first.name, first.arguments) == ("get_weather", '{"city": "Paris"}')
    assert second.name == "get_time" and second.arguments.startswith('{"timezone": "')
    assert json.loads(first.arguments) and finish_reason(chunks) == "length"
    assert streamed_content(chunks) == "Let me check both. "
    expected = whole(tool_stack.client, max_tokens=cut)
    assert expected.finish_reason == "length" and expected.message.tool_calls is None


def test_a_named_call_cut_by_max_tokens_is_sent_as_far_as_it_got(tool_stack):
    with tool_stack.replying(WEATHER_ARGUMENTS):
        chunks = stream(tool_stack.client, tool_choice=NAMED, max_tokens=4)
        expected = whole(tool_stack.client, tool_choice=NAMED, max_tokens=4)
    [call] = streamed_calls(chunks)
    assert call.name == "get_weather" and call.arguments == expected.message.content
    assert WEATHER_ARGUMENTS.startswith(call.arguments) and finish_reason(chunks) == "length"


def test_a_reply_whose_calls_are_broken_before_any_went_out_streams_as_text(tool_stack):
    # Not JSON: the non-stream reply is the whole text, and so is the stream.
    reply = 'Sure. <tool_call>\nget_weather(city="Paris")\n</tool_call>'
    with tool_stack.replying(reply):
        chunks = stream(tool_stack.client)
        expected = whole(tool_stack.client)
    assert streamed_content(chunks) == expected.message.content == reply
    assert finish_reason(chunks) == expected.finish_reason == "stop"
    assert not any(c.delta.tool_calls for chunk in chunks for c in chunk.choices)
