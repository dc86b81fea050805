"""Tool calling through the process split with the official `openai` client:
a named function and "required" constrain the reply to the tools' schemas
and come back as tool calls (streamed argument by argument, or whole); a
tool's result goes back in a "tool" message."""
from __future__ import annotations

import json

from serve_helpers import MODEL
from tool_stream_helpers import finish_reason, streamed_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                                       "properties": {"timezone": {"type": "string", "maxLength": 30}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def assert_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


def test_named_function_whole_and_streamed(client):
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert_weather_call(call)
    assert json.loads(call.function.arguments)["city"] == "Paris"
    # Streamed: the header, then the reply's text in pieces, adding up to the same arguments.
    chunks = [chunk for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices]
    [streamed] = streamed_calls(chunks)
    assert streamed.name == "get_weather" and streamed.arguments == call.function.arguments
    assert len(streamed.fragments) > 1 and finish_reason(chunks) == "stop"


def test_required_streamed_then_the_tool_result(client):
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                   max_tokens=100)
    chunks = [chunk for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices]
    calls = streamed_calls(chunks)
    assert finish_reason(chunks) == "tool_calls" and calls
    assert all(len(call.fragments) > 1 for call in calls)  # the parameters came in pieces
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    first = calls[0]
    assert first.name == "get_weather" and set(json.loads(first.arguments)) == {"city", "unit"}
    # The tool's answer goes back to the model in a "tool" message.
    follow_up = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                           {"id": first.id, "type": "function",
                            "function": {"name": first.name, "arguments": first.arguments}}]},
                       {"role": "tool", "tool_call_id": first.id, "content": "21 degrees celsius"}]
    reply = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_a_call_cut_by_max_tokens_comes_back_as_text(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.lstrip().startswith("{")


def test_a_streamed_call_keeps_the_prompt_logprobs(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body={"prompt_logprobs": 0})
    chunks = list(stream)
    assert sum(1 for chunk in chunks if getattr(chunk, "prompt_logprobs", None)) == 1
    [call] = streamed_calls([chunk for chunk in chunks if chunk.choices])
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
