"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser hermes:
a frontend in front of a fake scheduler whose model writes Hermes-style
tool calls after some text, read with the `openai` client (whole and
streamed), and the parser on its own."""
from __future__ import annotations

import json

import pytest

from frontend.tool_parsers.tool_parser_registry import HermesToolParser, partial_marker
from tests.frontend.tool_stack import ASK, REPLY, TOOLS
from tool_stream_helpers import finish_reason, streamed_calls, streamed_content


@pytest.fixture(scope="module")
def client(tool_stack):
    return tool_stack.client


def test_auto_returns_the_text_and_the_calls(client):
    reply = client.chat.completions.create(model="tiny-model", messages=ASK, tools=TOOLS)  # "auto" by default
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check both. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_auto_streams_the_text_then_the_calls(client):
    chunks = [c for c in client.chat.completions.create(model="tiny-model", messages=ASK, tools=TOOLS,
                                                        tool_choice="auto", stream=True) if c.choices]
    assert streamed_content(chunks) == "Let me check both. "  # streamed as it came, never a piece of "<tool_call>"
    assert [(call.index, call.name) for call in streamed_calls(chunks)] == [(0, "get_weather"), (1, "get_time")]
    assert finish_reason(chunks) == "tool_calls"


def test_without_tools_auto_is_plain_text(client):
    reply = client.chat.completions.create(model="tiny-model", messages=ASK)
    assert reply.choices[0].message.content == REPLY and reply.choices[0].message.tool_calls is None


def test_hermes_parser():
    parser = HermesToolParser()
    assert parser.extract("no call") == ("no call", [])
    content, calls = parser.extract('<tool_call>{"name": "f", "arguments": {"a": "é"}}</tool_call>')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": "é"})]
    # A call cut before its end tag still counts; broken JSON leaves the reply as text.
    assert [c.name for c in parser.extract('x <tool_call>{"name": "g", "arguments": {}}')[1]] == ["g"]
    assert parser.extract('x <tool_call>{"name": "g", "argu') == ('x <tool_call>{"name": "g", "argu', [])
    assert parser.extract('<tool_call>["not", "an object"]</tool_call>')[1] == []
    # Streaming: hold back anything that could begin "<tool_call>".
    assert [partial_marker(t, parser.START) for t in ("Hello", "Hello <", "Hello <tool_c", "a<b", "<tool_call")] == [
        0, 1, 7, 0, 10]
