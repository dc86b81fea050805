"""The incremental JSON scanner against `json.loads`: any JSON value, spaced any
way and fed in any pieces, is complete exactly at its end, with each value's
span; text json.loads rejects stops the scan where it goes wrong."""
from __future__ import annotations

import json

from hypothesis import given, strategies as st

from frontend.tool_parsers.json_scan import JsonScanner

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                      max_leaves=12)


def scan(text: str, cuts: list[int]) -> tuple[JsonScanner, list]:
    scanner, events = JsonScanner(), []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        events += scanner.feed(text[start:end])
    return scanner, events


@given(VALUES, st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " :\t")]), st.booleans(),
       st.lists(st.integers(0, 400), max_size=6))
def test_any_json_value_in_any_pieces(value, separators, ensure_ascii, cuts):
    text = json.dumps(value, separators=separators, ensure_ascii=ensure_ascii)
    scanner, events = scan(text, sorted(min(cut, len(text)) for cut in cuts))
    assert scanner.error is None and scanner.text == text
    # A number at the top level ends only when something follows it.
    assert scanner.done == (not isinstance(value, (int, float)) or isinstance(value, bool))
    for event in events:
        if event.kind == "end":
            json.loads(text[event.start:event.end])  # each span is a JSON value
    if scanner.done:
        assert (events[-1].depth, events[-1].start, events[-1].end) == (0, 0, len(text))


@given(VALUES, st.integers(0, 400))
def test_a_cut_value_is_valid_but_not_done(value, cut):
    text = json.dumps(value)
    if isinstance(value, (int, float)) or not 0 < cut < len(text):
        return
    scanner, _ = scan(text[:cut], [])
    assert scanner.error is None and not scanner.done


def test_keys_and_indices_name_the_values():
    text = '{"name": "f", "parameters": {"a": [1, true]}}'
    _, events = scan(text, [5, 17, 30])
    ends = [(e.depth, e.key, text[e.start:e.end]) for e in events if e.kind == "end"]
    assert ends == [(1, "name", '"f"'), (3, 0, "1"), (3, 1, "true"), (2, "a", "[1, true]"),
                    (1, "parameters", '{"a": [1, true]}'), (0, None, text)]


def test_what_json_rejects_stops_the_scan_where_it_goes_wrong():
    for text, valid in [('{"a" 1}', '{"a" '), ("[1,]", "[1,"), ("{,}", "{"), ("01", "0"), ('"\x01"', '"'),
                        ('{"a":1}}', '{"a":1}'), ("[1 2]", "[1 "), ("nulll", "null"), ('"\\x"', '"\\'),
                        ('{"a":1,}', '{"a":1,'), ("NaN", ""), ("[.5]", "["), ("get_weather()", "")]:
        scanner, _ = scan(text, [1])
        assert scanner.error is not None and scanner.text == valid, text
        assert scanner.feed("}") == [] and scanner.text == valid  # nothing more is read


@given(VALUES, st.sampled_from(["", " ", "; {\"x\": 1}", "]", "trailing text"]),
       st.lists(st.integers(0, 400), max_size=6))
def test_then_text_stops_at_the_end_of_the_value(value, after, cuts):
    # A value inside free text: the scan stops at its end (as json's raw_decode), whatever follows.
    text = json.dumps(value) + after
    scanner = JsonScanner(then_text=True)
    cuts = sorted(min(cut, len(text)) for cut in cuts)
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        scanner.feed(text[start:end])
    value_end = json.JSONDecoder().raw_decode(text)[1]
    if scanner.done:
        assert scanner.error is None and scanner.text == text[:value_end] == text[:scanner.end]
    else:  # a number with nothing after it: it may go on
        assert isinstance(value, (int, float)) and after == "" and scanner.text == text
