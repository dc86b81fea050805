"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser hermes:
a frontend in front of a fake scheduler whose model writes Hermes-style
tool calls after some text, read with the `openai` client (whole and
streamed), and the parser on its own."""
from __future__ import annotations

import json

import openai
import pytest

from frontend.tool_parsers import HermesToolParser
from tests.frontend.conftest import start_frontend
from tests.frontend.fakes import FakeControl, FakeScheduler, free_port

REPLY = ('Let me check both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def client(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto-tools")
    scheduler = FakeScheduler(f"tcp://127.0.0.1:{free_port()}", server.tokenizer.encode(REPLY),
                              server.eos_token_id).start()
    control_address = f"127.0.0.1:{free_port()}"
    control = FakeControl(256, len(server.tokenizer)).start(control_address)
    args = list(server.frontend_args)
    args[args.index("--scheduler-address") + 1] = scheduler.address
    args[args.index("--scheduler-control-address") + 1] = control_address
    frontend, base_url, _ = start_frontend([*args, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                                           tmp / "frontend.log")
    try:
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    finally:
        frontend.stop()
        control.stop()
        scheduler.stop()


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
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert text == "Let me check both. "  # streamed as it came, never a piece of "<tool_call>"
    assert [(call.index, call.function.name) for call in calls] == [(0, "get_weather"), (1, "get_time")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


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
    assert [parser.releasable(t) for t in ("Hello", "Hello <", "Hello <tool_c", "Hi <tool_call>{", "a<b")] == [
        5, 6, 6, 3, 3]
