"""tool_choice "auto" with each --tool-call-parser (hermes, llama3_json, mistral in
both its formats, pythonic), read with the `openai` client from a frontend in
front of a fake model that writes the parser's format (`tool_stack.FORMATS`):
the whole reply and the stream agree, text stays text."""
from __future__ import annotations

import json

import pytest

from tests.frontend.tool_stack import ASK, FORMATS, TOOLS
from tool_stream_helpers import finish_reason, streamed_calls, streamed_content


@pytest.fixture(params=list(FORMATS))
def form(request):
    return FORMATS[request.param]


@pytest.fixture
def stack(form, tool_stacks):
    stack = tool_stacks(form.parser)
    with stack.replying(form.reply):
        yield stack


def whole(stack, **request):
    return stack.client.chat.completions.create(**{"model": "tiny-model", "messages": ASK, "tools": TOOLS,
                                                   **request}).choices[0]


def stream(stack, **request) -> list:
    return [chunk for chunk in stack.client.chat.completions.create(
        **{"model": "tiny-model", "messages": ASK, "tools": TOOLS, "stream": True, **request}) if chunk.choices]


def check_ids(form, ids: list[str]) -> None:
    assert len(set(ids)) == len(ids)
    if form.parser == "mistral":  # what Mistral's chat templates accept back
        assert all(len(i) == 9 and i.isalnum() for i in ids), ids
    else:
        assert all(i.startswith("chatcmpl-tool-") for i in ids), ids


def test_the_whole_reply_is_the_text_before_and_the_calls(form, stack):
    choice = whole(stack)
    assert choice.finish_reason == "tool_calls" and choice.message.content == form.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == form.calls
    check_ids(form, [c.id for c in choice.message.tool_calls])


def test_the_stream_adds_up_to_the_whole_reply(form, stack):
    expected = whole(stack)
    chunks = stream(stack)
    calls = streamed_calls(chunks)
    # The streamed arguments are the model's JSON text; the whole reply's the same, re-serialised.
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected.message.tool_calls] == form.calls
    assert streamed_content(chunks) == (expected.message.content or "")
    assert finish_reason(chunks) == expected.finish_reason == "tool_calls"
    assert len(calls[0].fragments) > 1  # argument pieces, not the whole arguments at the end
    check_ids(form, [c.id for c in calls])


def test_the_openai_stream_helper_builds_the_calls(form, stack):
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    with stack.client.chat.completions.stream(model="tiny-model", messages=ASK, tools=strict) as events:
        done = [event.name for event in events if event.type == "tool_calls.function.arguments.done"]
        final = events.get_final_completion().choices[0]
    assert done == [name for name, _ in form.calls]
    assert [(c.function.name, c.function.parsed_arguments) for c in final.message.tool_calls] == form.calls
    # (The helper's content is "" when none came: the role chunk's.)
    assert final.finish_reason == "tool_calls" and (final.message.content or None) == form.content


@pytest.mark.parametrize("kind", ["plain", "malformed"])
def test_a_reply_without_well_formed_calls_is_text_whole_and_streamed(form, stack, kind):
    text = getattr(form, kind)
    with stack.replying(text):
        expected = whole(stack)
        chunks = stream(stack)
    assert expected.message.tool_calls is None and expected.finish_reason == "stop"
    shown = text.replace("<|python_tag|>", "")  # a special token the reply is decoded without
    assert expected.message.content == streamed_content(chunks) == shown
    assert finish_reason(chunks) == "stop" and streamed_calls(chunks) == []


def test_a_reply_cut_by_max_tokens_in_its_second_call(form, stack):
    # The stream has sent the first call whole and perhaps the second one's start (a
    # header goes out once a call's name and arguments have begun; pythonic: with its
    # first argument), with finish reason "length"; the whole reply cannot be parsed: text.
    tokens = stack.tokenizer.encode(form.reply)
    cut = next(n for n in range(len(tokens)) if "timezone" in stack.tokenizer.decode(tokens[:n]))
    chunks = stream(stack, max_tokens=cut)
    calls = streamed_calls(chunks)
    assert [(c.name, json.loads(c.arguments)) for c in calls[:1]] == form.calls[:1]
    assert [c.name for c in calls[1:]] == (["get_time"] if form.parser != "pythonic" else [])
    assert all(c.arguments.startswith('{"timezone') for c in calls[1:])
    assert finish_reason(chunks) == "length" and streamed_content(chunks) == (form.content or "")
    expected = whole(stack, max_tokens=cut)
    assert expected.finish_reason == "length" and expected.message.tool_calls is None
    assert "timezone" in expected.message.content


def test_mistral_markers_are_special_tokens_the_reply_is_decoded_with(tool_stacks):
    stack = tool_stacks("mistral")
    form = FORMATS["mistral"]
    assert len(stack.tokenizer.encode("[TOOL_CALLS]")) == 1  # one special token, as in Mistral's tokenizers
    # Without tools (no parser), special tokens are skipped as usual: the marker is gone.
    plain = stack.client.chat.completions.create(model="tiny-model", messages=ASK).choices[0]
    assert plain.message.content == form.reply.replace("[TOOL_CALLS]", "")
    # With the parser they are kept, even when the client asked to skip them (as vLLM).
    choice = whole(stack, extra_body={"skip_special_tokens": True})
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
