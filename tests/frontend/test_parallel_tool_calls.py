"""`parallel_tool_calls: false`, as vLLM: at most one tool call per reply.
"auto" keeps the first call the model writes (whole and streamed); "required"
constrains the reply to a list of exactly one call, so the model cannot write a
second. Read with the `openai` client from a frontend in front of a fake model
(`tool_stack.py`) that writes two hermes calls."""
from __future__ import annotations

import json

import pytest
import xgrammar

from common.structured_outputs import build_grammar
from frontend.openai.tool_calls import resolve_tool_choice, tool_call_output
from tests.frontend.tool_stack import ASK, TOOLS
from tool_stream_helpers import finish_reason, streamed_calls, streamed_content

WEATHER = {"name": "get_weather", "parameters": {"city": "Paris"}}
TIME = {"name": "get_time", "parameters": {"timezone": "CET"}}


def grammar_accepts(tools, parallel_tool_calls: bool, text: str) -> bool:
    spec = tool_call_output(tools, resolve_tool_choice(tools, "required", parallel_tool_calls=parallel_tool_calls))
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(build_grammar(spec))
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("parallel_tool_calls, accepts_two", [(True, True), (False, False)])
def test_required_allows_a_second_call_only_when_parallel(parallel_tool_calls, accepts_two):
    assert grammar_accepts(TOOLS, parallel_tool_calls, json.dumps([WEATHER]))
    assert grammar_accepts(TOOLS, parallel_tool_calls, json.dumps([WEATHER, TIME])) is accepts_two


def test_required_asks_the_worker_for_one_call(tool_stack):
    tool_stack.client.chat.completions.create(model="tiny-model", messages=ASK, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=4)
    schema = json.loads(tool_stack.scheduler.snapshot().requests[-1].sampling_params.structured_outputs.json)
    assert schema["maxItems"] == 1


def test_auto_keeps_the_first_call_whole_and_streamed(tool_stack):
    request = dict(model="tiny-model", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    parallel = tool_stack.client.chat.completions.create(**{**request, "parallel_tool_calls": True}).choices[0]
    single = tool_stack.client.chat.completions.create(**request).choices[0]
    assert [call.function.name for call in parallel.message.tool_calls] == ["get_weather", "get_time"]
    assert [(c.function.name, c.function.arguments) for c in single.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in parallel.message.tool_calls[:1]]
    assert (single.message.content, single.finish_reason) == (parallel.message.content, "tool_calls")

    chunks = [chunk for chunk in tool_stack.client.chat.completions.create(**request, stream=True) if chunk.choices]
    assert [(call.name, call.arguments) for call in streamed_calls(chunks)] == \
        [(c.function.name, c.function.arguments) for c in single.message.tool_calls]
    assert streamed_content(chunks) == single.message.content and finish_reason(chunks) == "tool_calls"


def test_a_response_holds_one_function_call(tool_stack):
    tools = [{"type": "function", "name": tool["function"]["name"], "parameters": tool["function"]["parameters"]}
             for tool in TOOLS]
    request = dict(model="tiny-model", input="Weather and time in Paris?", tools=tools, parallel_tool_calls=False)
    response = tool_stack.client.responses.create(**request)
    assert response.parallel_tool_calls is False
    assert [item.name for item in response.output if item.type == "function_call"] == ["get_weather"]
    with tool_stack.client.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    assert [(item.type, getattr(item, "arguments", None)) for item in streamed.output] == \
        [(item.type, getattr(item, "arguments", None)) for item in response.output]
