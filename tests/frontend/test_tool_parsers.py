"""The llama3_json, mistral and pythonic parsers on whole replies: tricky JSON and
Python, what stays text (hermes: test_auto_tool_choice.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend.tool_parsers.tool_parser_registry import (TOOL_PARSERS, Llama3JsonToolParser, MistralToolParser,
                                                        PythonicToolParser)


def calls(parser, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    """(content, [(name, arguments as JSON)]), checking the arguments are JSON text."""
    content, found = parser.extract(text)
    return content, [(call.name, json.loads(call.arguments)) for call in found]


def is_text(parser, text: str) -> bool:
    return parser.extract(text) == (text, [])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_serve_hands_each_parser_to_the_frontend(name, tmp_path):
    from pagedserve.serve import build_parser, component_commands
    from frontend.frontend_cli import build_parser as frontend_parser

    args = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", name])
    frontend = next(c for c in component_commands(args, str(tmp_path)) if c.name == "frontend")
    parsed = frontend_parser().parse_args(frontend.argv[1:])
    assert (parsed.enable_auto_tool_choice, parsed.tool_call_parser) == (True, name)
    assert TOOL_PARSERS[name].name == name


@pytest.mark.parametrize("name, keeps", [("hermes", True), ("mistral", True), ("llama3_json", False),
                                         ("pythonic", False)])
def test_replies_are_decoded_with_special_tokens_when_the_markers_are_some(name, keeps):
    # As vLLM: hermes' <tool_call> (in some models) and mistral's [TOOL_CALLS] are special tokens;
    # llama3_json's <|python_tag|> is one too, but vLLM reads the reply without it.
    from frontend.openai.request_bodies import ChatCompletionRequest

    def skips(tools, tool_choice=None) -> bool:
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                     tool_choice=tool_choice, skip_special_tokens=True)
        body.enable_auto_tools(name)
        return body.sampling_params().skip_special_tokens

    tools = [{"type": "function", "function": {"name": "f"}}]
    assert skips(tools) is not keeps
    assert skips(None) and skips(tools, "none")  # no parser at work: as the client asked


# --- llama3_json -------------------------------------------------------------------
LLAMA = Llama3JsonToolParser()


def test_llama3_calls_with_or_without_the_python_tag_and_content_before():
    assert calls(LLAMA, '{"name": "f", "parameters": {"a": 1}}') == (None, [("f", {"a": 1})])
    assert calls(LLAMA, '<|python_tag|>{"name": "f", "arguments": {}}') == (None, [("f", {})])
    assert calls(LLAMA, 'Sure, let me look.\n\n<|python_tag|> {"name": "f", "parameters": {"a": 1}}') == (
        "Sure, let me look.\n\n", [("f", {"a": 1})])
    assert calls(LLAMA, 'Checking. {"type": "function", "name": "f", "parameters": {}}') == ("Checking. ", [("f", {})])


def test_llama3_several_calls_separated_by_semicolons_or_whitespace():
    text = '{"name": "f", "parameters": {"a": 1}};{"name": "g", "parameters": {}} ;\n {"name": "h", "parameters": {}}'
    assert calls(LLAMA, text) == (None, [("f", {"a": 1}), ("g", {}), ("h", {})])
    assert calls(LLAMA, '{"name": "f", "parameters": {}}\n{"name": "g", "parameters": {}}')[1] == [("f", {}), ("g", {})]


def test_llama3_tricky_json():
    nested = {"q": {"deep": [{"x": [1, 2, {"y": None}]}], "t": True}, "n": -1.5e3}
    assert calls(LLAMA, json.dumps({"name": "f", "parameters": nested}))[1] == [("f", nested)]
    # Strings holding the separators, braces and brackets, escapes and unicode.
    text = ('{"name": "f", "parameters": {"s": "a; b} ] {c", "q": "say \\"hi\\"", "u": "caf\\u00e9 日本 🙂"}}; '
            '{"name": "ünïcode", "parameters": {"k;}": "]"}}')
    assert calls(LLAMA, text)[1] == [("f", {"s": "a; b} ] {c", "q": 'say "hi"', "u": "café 日本 🙂"}),
                                     ("ünïcode", {"k;}": "]"})]
    # The non-stream arguments are re-serialised JSON (unicode kept, as vLLM's ensure_ascii=False).
    assert LLAMA.extract('{"name": "f", "parameters": {"u":"\\u00e9"}}')[1][0].arguments == '{"u": "é"}'


def test_llama3_text_after_the_calls_is_dropped():
    assert calls(LLAMA, 'A. {"name": "f", "parameters": {}}; then I will answer.') == ("A. ", [("f", {})])
    assert calls(LLAMA, '{"name": "f", "parameters": {}}\n\nDone {ok}.') == (None, [("f", {})])


@pytest.mark.parametrize("text", [
    "no call at all", "", 'Use {city} here.', 'A dict: {"a": 1}', '{"name": "Bob"}',  # no arguments: not a call
    '{"parameters": {}}', '{"name": 3, "parameters": {}}', '{"name": "f", "parameters": {"a": 1,}}',
    '{"name": "f", "parameters": {"a": 1}', '<|python_tag|>brave_search.call(query="x")',
    'Text {"name": "f", "parameters": {}}; {"name": "g"}',  # the second call has no arguments
])
def test_llama3_replies_that_stay_text(text):
    assert is_text(LLAMA, text)


# --- mistral -----------------------------------------------------------------------
MISTRAL = MistralToolParser()


def test_mistral_json_list_format():
    text = ('Let me check.[TOOL_CALLS] [{"name": "f", "arguments": {"s": "a], [TOOL_CALLS] b", "l": [[1], {}]}}, '
            '{"name": "g"}]')
    assert calls(MISTRAL, text) == ("Let me check.", [("f", {"s": "a], [TOOL_CALLS] b", "l": [[1], {}]}), ("g", {})])
    assert calls(MISTRAL, '[TOOL_CALLS][{"name": "météo", "arguments": {"ville": "Zürich 🙂"}}]</s> and more') == (
        None, [("météo", {"ville": "Zürich 🙂"})])


def test_mistral_name_args_format():
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "n": {"a": [1, "}"]}}[TOOL_CALLS]get_time{"tz": "CET"}'
    assert calls(MISTRAL, text) == ("Sure.", [("get_weather", {"city": "Paris", "n": {"a": [1, "}"]}}),
                                             ("get_time", {"tz": "CET"})])
    # A string that holds the marker is JSON, not the next call; text after a call is dropped.
    assert calls(MISTRAL, '[TOOL_CALLS]f[ARGS] {"s": "[TOOL_CALLS]g{}"} trailing')[1] == [
        ("f", {"s": "[TOOL_CALLS]g{}"})]
    # Both formats in one reply, numbered in order.
    both = '[TOOL_CALLS][{"name": "a"}, {"name": "b"}][TOOL_CALLS]c[ARGS]{}'
    assert [name for name, _ in calls(MISTRAL, both)[1]] == ["a", "b", "c"]


def test_mistral_call_ids_are_nine_letters_and_digits():
    ids = {MISTRAL.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)


@pytest.mark.parametrize("text", [
    "no call", "[TOOL_CALLS]", "Hi [TOOL_CALLS] ", '[TOOL_CALLS]["f"]', '[TOOL_CALLS][{"arguments": {}}]',
    '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}', '[TOOL_CALLS]get weather[ARGS]{}', '[TOOL_CALLS]f[ARGS]"x"',
    '[TOOL_CALLS]f[ARGS]{"a": }', '[TOOL_CALLS]f', "[TOOL_CALLS][ARGS]{}", '[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g',
])
def test_mistral_replies_that_stay_text(text):
    assert is_text(MISTRAL, text)


# --- pythonic ----------------------------------------------------------------------
PYTHONIC = PythonicToolParser()


def test_pythonic_literals_become_json():
    text = ('[search(query="café ☕", limit=-3, ratio=+0.5, exact=True, fuzzy=False, lang=None, '
            'tags=["a", \'b\'], where={"lat": 48.85, "nested": {"x": [1, (2, 3)]}}, flags=(), raw=null, on=true)]')
    assert calls(PYTHONIC, text) == (None, [("search", {
        "query": "café ☕", "limit": -3, "ratio": 0.5, "exact": True, "fuzzy": False, "lang": None,
        "tags": ["a", "b"],
        "where": {"lat": 48.85, "nested": {"x": [1, [2, 3]]}}, "flags": [], "raw": None, "on": True})])


def test_pythonic_strings_that_hold_the_syntax():
    text = ('[f(a="x), g(y=1)]", b=\'it\\\'s\', c="\\"q\\"", d="""line 1\nline "2"\n""", e=r"C:\\dir", '
            "h='''']'''),\n   g()]")
    assert calls(PYTHONIC, text) == (None, [
        ("f", {"a": "x), g(y=1)]", "b": "it's", "c": '"q"', "d": 'line 1\nline "2"\n', "e": "C:\\dir", "h": "']"}),
        ("g", {})])


def test_pythonic_call_shapes():
    assert calls(PYTHONIC, "  [a.b.search(q='x',), noargs( ), ünï(k=1)]  ") == (
        None, [("a.b.search", {"q": "x"}), ("noargs", {}), ("ünï", {"k": 1})])
    assert calls(PYTHONIC, "<|python_start|>[f(x=1)]<|python_end|>") == (None, [("f", {"x": 1})])  # Llama 4
    assert calls(PYTHONIC, "[f(x=1)] That is all.") == (None, [("f", {"x": 1})])  # text after the list: dropped
    assert PYTHONIC.extract("[f(b=1, a=[1,2])]")[1][0].arguments == '{"b": 1, "a": [1, 2]}'  # in the written order


@pytest.mark.parametrize("text", [
    "Sure: [f(x=1)]", "[]", "[1, 2]", "[Note] see below", "[f]", "[f(1)]", "[f(x=1, 2)]", "[f(x=y)]",
    "[f(x=1, x=2)]", "[f(**kw)]", "[f(x=f'{y}')]", "[f(x=b'raw')]", "[f(x={1, 2})]", "[f(x={1: 2})]", "[f(x=1e999)]",
    "[f(x=1 + 2)]", "[f(x=[i for i in y])]", "[f(x=1 # note\n)]", "[f(x='a\nb')]", "[f(x=1)", "[f(x=1), g(y='",
    "[f(x=1),, g()]", "[f(x=1) g()]", "[1f(x=1)]", "[f(x=(1]))]", "[f(,)]",
])
def test_pythonic_replies_that_stay_text(text):
    assert is_text(PYTHONIC, text)


def test_pythonic_never_evaluates(tmp_path: Path):
    marker = tmp_path / "evaluated"
    text = f'[f(x=__import__("os").system("touch {marker}")), g(y=open("{marker}", "w"))]'
    assert is_text(PYTHONIC, text) and not marker.exists()
