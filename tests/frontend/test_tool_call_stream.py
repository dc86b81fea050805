"""`ToolCallStream` on its own, fed a reply in pieces: what goes out as content
and as tool-call deltas, and the finish reason, including replies that stop
being calls before or after a call went out."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from frontend.openai.tool_call_stream import tool_call_stream
from frontend.openai.tool_calls import ToolChoice, tool_call_reply
from frontend.tool_parsers.tool_parser_registry import TOOL_PARSERS, HermesToolParser

AUTO, REQUIRED, NAMED = ToolChoice("auto", parser=HermesToolParser()), ToolChoice("required"), ToolChoice("named", "f")


def run(choice: ToolChoice, pieces: list[str], finish_reason: str = "stop") -> tuple[str, list[tuple], str | None]:
    """(content, [(name, arguments, number of deltas)], finish reason)"""
    stream = tool_call_stream(choice)
    steps = [stream.feed(piece) for piece in pieces[:-1]] + [stream.finish(pieces[-1], finish_reason)]
    calls: dict[int, list] = {}
    for delta in (d for step in steps for d in step.tool_calls):
        if "id" in delta:
            assert delta["index"] not in calls and delta["type"] == "function"
            calls[delta["index"]] = [delta["function"]["name"], "", 0]
        calls[delta["index"]][1] += delta["function"]["arguments"]
        calls[delta["index"]][2] += 1
    assert all(step.finish_reason is None for step in steps[:-1])
    return "".join(step.content for step in steps), [tuple(calls[i]) for i in sorted(calls)], steps[-1].finish_reason


def chars(text: str) -> list[str]:
    return list(text)


def cut(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({min(cut, len(text)) for cut in cuts} - {0, len(text)})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def auto(parser: str) -> ToolChoice:
    return ToolChoice("auto", parser=TOOL_PARSERS[parser]())


# Tricky replies of each parser: content, several calls, strings holding the
# format's syntax, unicode, and text after the calls (dropped).
REPLIES = {
    "hermes": ('Sure. <tool_call>{"name": "f", "arguments": {"a": "x</y", "b": [1, 2.5]}}</tool_call>\n'
               '<tool_call>{"arguments": {"é": "🙂"}, "name": "g"}</tool_call> bye'),
    "llama3_json": ('Checking. <|python_tag|>{"name": "f", "parameters": {"s": "a; b} ]", "n": [1, {"x": null}]}}; '
                    '{"name": "g", "arguments": {"é": "🙂"}} then text'),
    "mistral": ('Hi![TOOL_CALLS] [{"name": "f", "arguments": {"s": "a], b"}}, {"name": "g"}] x'
                '[TOOL_CALLS]h[ARGS]{"k": [1, "}"]}'),
    "pythonic": "[f(s=\"a), b]\", n=[1, {'x': None}], t=True), g(), h(k=-2.5, u='日本 \\'',)] bye",
}


@given(st.lists(st.integers(1, 200), max_size=8), st.sampled_from(["", "Sure. ", "a < b "]))
def test_any_pieces_add_up_to_the_whole_reply(cuts, prefix):
    text = (prefix + '<tool_call>{"name": "f", "arguments": {"a": "x</y", "b": [1, 2.5]}}</tool_call>\n'
            '<tool_call>{"arguments": {}, "name": "g"}</tool_call>')
    cuts = sorted({min(cut, len(text)) for cut in cuts} - {0, len(text)})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls, finish = run(AUTO, pieces)
    whole = tool_call_reply(text, "stop", AUTO)
    assert (content, [call[:2] for call in calls], finish) == (
        whole.content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls],
        whole.finish_reason)


def test_text_that_only_looks_like_a_tag_streams_as_it_comes():
    assert run(AUTO, chars("a <tool b")) == ("a <tool b", [], "stop")


def test_a_call_without_arguments_gets_an_empty_object():
    # The header goes out when the name is complete, the arguments when the call is.
    assert run(AUTO, chars('<tool_call>{"name": "g"}</tool_call>')) == ("", [("g", "{}", 2)], "tool_calls")


def test_a_reply_that_breaks_before_a_call_went_out_is_text():
    for text in ['Hi <tool_call>{"name": 3}</tool_call>', 'Hi <tool_call>{"arguments": {}}</tool_call>',
                 'Hi <tool_call>["f"]</tool_call>', 'Hi <tool_call>{"name</tool_call>']:
        assert run(AUTO, chars(text)) == (text, [], "stop")
    assert run(REQUIRED, chars('[{"name": "get_we'), "length") == ('[{"name": "get_we', [], "length")


def test_once_a_call_went_out_it_stands():
    # Broken JSON after the name: what was valid went out, the rest is dropped;
    # the reply is not whole calls, so the finish reason is the sample's.
    content, calls, finish = run(AUTO, chars('Hi <tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call>'))
    assert (content, [c[:2] for c in calls], finish) == ("Hi ", [("f", '{"a": 1,')], "stop")
    content, calls, finish = run(REQUIRED, chars('[{"name": "f", "parameters": {"a": "lo'), "length")
    assert (content, [c[:2] for c in calls], finish) == ("", [("f", '{"a": "lo')], "length")


def test_required_streams_each_parameters_object_as_written():
    text = '[{"parameters": {"a":1}, "name": "f"},{"name":"g","parameters":{"b":[true]}}]'
    content, calls, finish = run(REQUIRED, chars(text))
    assert (content, [c[:2] for c in calls], finish) == ("", [("f", '{"a":1}'), ("g", '{"b":[true]}')], "tool_calls")
    assert calls[0][2] == 1 and calls[1][2] > 1  # f's name came after its parameters: all in its header


def test_named_sends_the_header_at_once_then_the_text():
    stream = tool_call_stream(NAMED)
    [header] = stream.feed("").tool_calls
    assert header["function"] == {"name": "f", "arguments": ""} and header["id"].startswith("chatcmpl-tool-")
    assert stream.feed('{"a"').tool_calls == [{"index": 0, "function": {"arguments": '{"a"'}}]
    step = stream.finish(": 1}", "stop")
    assert step.tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}] and step.finish_reason == "stop"
    assert json.loads(stream.text) == {"a": 1}


@given(st.sampled_from(sorted(REPLIES)), st.lists(st.integers(1, 200), max_size=8))
def test_any_pieces_of_each_format_add_up_to_the_whole_reply(parser, cuts):
    text = REPLIES[parser]
    content, calls, finish = run(auto(parser), cut(text, cuts))
    whole = tool_call_reply(text, "stop", auto(parser))
    assert content == (whole.content or "") and finish == whole.finish_reason == "tool_calls"
    # The streamed arguments are the model's text, the whole reply's re-serialised: equal as JSON.
    assert [(name, json.loads(arguments)) for name, arguments, _ in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls]
    assert len(calls) == 3 if parser in ("mistral", "pythonic") else len(calls) == 2


@given(st.sampled_from(sorted(REPLIES)), st.integers(1, 200), st.lists(st.integers(1, 200), max_size=4))
def test_a_reply_cut_anywhere_streams_what_the_whole_reply_would_not_take_back(parser, length, cuts):
    # Cut by max_tokens: nothing streamed yet is text (as the whole reply); else the
    # calls sent are the start of the whole reply's, and the finish reason stays
    # "length" (unless the calls happen to be complete: then the whole reply's).
    full_content, full_calls, _ = run(auto(parser), chars(REPLIES[parser]))
    text = REPLIES[parser][:length]
    content, calls, finish = run(auto(parser), cut(text, cuts), "length")
    whole = tool_call_reply(text, "length", auto(parser))
    assert finish == (whole.finish_reason if whole is not None else "length")
    if not calls:
        assert content == text
    else:
        assert content == full_content and len(calls) <= len(full_calls)
        assert all(name == full[0] and full[1].startswith(arguments)
                   for (name, arguments, _), full in zip(calls, full_calls))


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", 'Fill in {"city": "Paris"} and {x}.'), ("llama3_json", 'Sure. {"name": f, "parameters": {}}'),
    ("mistral", "Use [TOOL form]."), ("mistral", "[TOOL_CALLS]get weather[ARGS]{}"), ("mistral", "[TOOL_CALLS]{}"),
    ("pythonic", "[1] is a footnote."), ("pythonic", "[get_weather(city=Paris)]"), ("pythonic", "  Plain text"),
])
def test_a_reply_that_is_not_calls_streams_as_text(parser, text):
    assert run(auto(parser), chars(text)) == (text, [], "stop")


def test_pythonic_streams_argument_by_argument():
    stream = tool_call_stream(auto("pythonic"))
    reply = '[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]'
    steps = [stream.feed(char) for char in reply[:-1]] + [stream.finish(reply[-1], "stop")]
    pieces = [(d["index"], d["function"].get("name"), d["function"]["arguments"]) for s in steps for d in s.tool_calls]
    # The last argument ends at the ")", which ends the arguments' JSON too.
    assert pieces == [(0, "get_weather", '{"city": "Paris"'), (0, None, ', "unit": "celsius"}'),
                      (1, "get_time", '{"timezone": "CET"}')]
    # The header waits for a call's first argument: a call broken before it never went out.
    assert run(auto("pythonic"), chars("[f(a=1), g(b=x)]")) == ("", [("f", '{"a": 1}', 1)], "stop")
