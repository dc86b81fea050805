"""Tool calling through the process split with the official `openai` client:
a named function and "required" constrain the reply to the tools' schemas
and come back as tool calls (streamed or not); a tool's result goes back in
a "tool" message."""
from __future__ import annotations

import json

from serve_helpers import MODEL

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


def test_named_function(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert_weather_call(call)
    assert json.loads(call.function.arguments)["city"] == "Paris"


def test_required_streamed_then_the_tool_result(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            temperature=0, max_tokens=100, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [call.index for call in calls] == list(range(len(calls))) and calls
    assert_weather_call(calls[0])
    # The tool's answer goes back to the model in a "tool" message.
    follow_up = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                           {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}]},
                       {"role": "tool", "tool_call_id": calls[0].id, "content": "21 degrees celsius"}]
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
    [call] = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert_weather_call(call)
