"""StopStringMatcher: hand-picked cases and hypothesis properties over random texts, stops and splits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.stop_strings import StopStringMatcher


def run(stop: tuple[str, ...], deltas: list[str]) -> tuple[list[str], bool]:
    """Every emitted piece (the flush last) and whether a stop string matched; feeding ends on a match."""
    matcher = StopStringMatcher(stop)
    pieces = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        pieces.append(text)
        if matched:
            return pieces, True
    return pieces + [matcher.flush()], False


def expected_output(text: str, stop: tuple[str, ...]) -> str:
    """`text` cut at the stop string that completes first (the longest one if several end together)."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop if text[:end].endswith(s)]
        if ending_here:
            return text[: end - max(map(len, ending_here))]
    return text


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0] + sorted(c % (len(text) + 1) for c in cuts) + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_no_stop_strings_passes_everything_through():
    assert run((), ["a", "bc", ""]) == (["a", "bc", "", ""], False)


def test_stop_string_spanning_deltas():
    pieces, matched = run(("</end>",), ["Hello </", "en", "d> ignored"])
    assert matched and pieces == ["Hello ", "", ""]


def test_holds_back_a_possible_start_then_releases_it():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed(" S") == (" ", False)
    assert matcher.flush() == "S"


def test_match_inside_one_delta_truncates():
    assert run(("\n\n",), ["one\n\ntwo"]) == (["one"], True)


def test_stop_at_the_very_start():
    assert run(("abc",), ["ab", "c"]) == (["", ""], True)


def test_first_completed_stop_wins():
    # "bc" completes before "abcd" could, as a stream sees it
    assert run(("abcd", "bc"), ["abcd"]) == (["a"], True)
    # when two end together the longer one (earlier start) is cut
    assert run(("bc", "abc"), ["xab", "c"]) == (["x", ""], True)


def test_feed_after_match_emits_nothing():
    matcher = StopStringMatcher(("x",))
    assert matcher.feed("ax") == ("a", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(("ok", ""))


small_text = st.text(alphabet="abc\n😀é", max_size=30)
stop_strings = st.lists(st.text(alphabet="abc\n😀é", min_size=1, max_size=4), max_size=3).map(tuple)


@settings(max_examples=500, deadline=None)
@given(text=small_text, stop=stop_strings, cuts=st.lists(st.integers(0, 40), max_size=10))
def test_emitted_text_is_text_up_to_the_first_stop(text, stop, cuts):
    pieces, matched = run(stop, split(text, cuts))
    expected = expected_output(text, stop)
    assert "".join(pieces) == expected
    assert matched == any(s in text for s in stop)


@settings(max_examples=300, deadline=None)
@given(text=small_text, stop=stop_strings, cuts=st.lists(st.integers(0, 40), max_size=10))
def test_never_emits_what_may_start_a_stop_string(text, stop, cuts):
    matcher = StopStringMatcher(stop)
    emitted, seen = "", ""
    for delta in split(text, cuts):
        piece, matched = matcher.feed(delta)
        emitted, seen = emitted + piece, seen + delta
        if matched:
            break
        # no emitted position starts a stop string occurrence, complete or still incomplete
        for start in range(len(emitted)):
            tail = seen[start:]
            assert not any(s.startswith(tail) or tail.startswith(s) for s in stop)
