"""StopChecker against a direct reference: the output ends before the stop
string occurrence that ends first, whatever the chunking, and text released
while streaming is never part of a stop string."""
from hypothesis import given, settings
from hypothesis import strategies as st

from common.stop_checker import StopChecker


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """(output text, matched stop) computed on the whole text at once."""
    best = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if stop and start != -1 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is None:
        return text, None
    end, start, stop = best
    return text[:end if include else start], stop


def run(chunks: list[str], stops: list[str], include: bool = False) -> tuple[list[str], str | None]:
    checker = StopChecker(stops, include)
    released = [checker.feed(chunk) for chunk in chunks]
    if checker.matched is None:
        released.append(checker.flush())
    return released, checker.matched


def test_stop_string_spanning_chunks_is_cut_before_it():
    released, matched = run(["Hel", "lo wo", "rld! How", " are you"], ["world!"])
    assert "".join(released) == "Hello "
    assert matched == "world!"


def test_text_that_may_begin_a_stop_string_is_held_back_then_released():
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST") == "abc "
    assert checker.feed("O") == ""
    assert checker.feed("PPED") == ""  # "STOP" completed: nothing after it
    assert checker.matched == "STOP"
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST") == "abc "
    assert checker.feed("ART") == "START"  # not a stop after all: released
    assert checker.flush() == ""


def test_include_stop_str_in_output():
    released, matched = run(["a ", "b", "c d"], ["bc"], include=True)
    assert "".join(released) == "a bc"
    assert matched == "bc"


def test_earliest_ending_match_wins():
    # "bc" ends before "abcd" does, even when both arrive in one chunk.
    assert run(["abcd"], ["abcd", "bc"]) == (["a"], "bc")
    assert run(["a", "b", "c", "d"], ["abcd", "bc"])[1] == "bc"


def test_no_stop_strings_releases_everything_immediately():
    checker = StopChecker([])
    assert [checker.feed(c) for c in ["a", "", "bc"]] == ["a", "", "bc"]
    assert checker.matched is None


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="ab c", max_size=30),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
       include=st.booleans())
def test_matches_reference_for_any_chunking(text, stops, cuts, include):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    released, matched = run(chunks, stops, include)
    expected_text, expected_stop = reference(text, stops, include)
    assert "".join(released) == expected_text
    assert matched == expected_stop
    if not include:
        # Nothing released is ever part of the stop string that ends the output.
        for stop in stops:
            assert stop not in "".join(released)


def test_unchecked_text_cannot_end_a_match_but_may_begin_one():
    """min_tokens: the first tokens' text is fed unchecked (as vLLM skips them)."""
    checker = StopChecker(["b", "yz"])
    assert checker.feed("abxy", check=False) == "abx"  # "b" is not a match yet; "y" may begin "yz"
    assert checker.matched is None
    assert checker.feed("z!") == ""
    assert checker.matched == "yz"
    checker = StopChecker(["b"])
    assert [checker.feed("ab", check=False), checker.feed("cb")] == ["ab", "c"]
    assert checker.matched == "b"
