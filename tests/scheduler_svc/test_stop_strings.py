"""StopStringMatcher: hand-picked cases, hypothesis properties over random texts, stops and splits,
a seeded comparison with a brute-force matcher, and bounds on its memory and time."""

import random
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from scheduler_svc.stop_strings import StopAutomaton, StopStringMatcher


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


class BruteForceMatcher:
    """The specification, quadratic and obvious: rescan everything unemitted at every feed."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.held, self.matched = stop, "", False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        text = self.held + delta
        found = [(text.find(s) + len(s), -len(s)) for s in self.stop if s in text]
        if found:
            end, minus_length = min(found)  # ends first; then the longest
            self.held, self.matched = "", True
            return text[: end + minus_length], True
        num_held = max((n for s in self.stop for n in range(1, len(s))
                        if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.matched else held


def random_case(rng: random.Random) -> tuple[tuple[str, ...], list[str]]:
    """Stop strings and deltas over a small alphabet, so that they overlap, nest and repeat; some
    deltas are empty, as the detokenizer's can be."""
    alphabet = rng.choice(["ab", "abc", "abcd", "a\n😀"])
    word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
    stop = tuple(word(rng.randint(1, 8)) for _ in range(rng.choice([1, 2, 4, 12, 40])))
    deltas = [word(rng.choice([0, 0, 1, 1, 2, 3, 5, 12])) for _ in range(rng.randint(0, 30))]
    return stop, deltas


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_feed_by_feed(seed):
    rng = random.Random(seed)
    for _ in range(100):
        stop, deltas = random_case(rng)
        matcher, reference = StopStringMatcher(stop), BruteForceMatcher(stop)
        for delta in deltas + ["more"]:  # feeding after a match must emit nothing
            assert matcher.feed(delta) == reference.feed(delta), (stop, deltas)
            assert matcher.matched == reference.matched
        assert matcher.flush() == reference.flush(), (stop, deltas)


def peak_memory_of(work) -> int:
    """Bytes allocated by `work()` at its peak, as tracemalloc sees them."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def feed_all(matcher: StopStringMatcher, deltas) -> tuple[str, bool]:
    emitted = ""
    for delta in deltas:
        piece, matched = matcher.feed(delta)
        emitted += piece
        if matched:
            return emitted, True
    return emitted + matcher.flush(), False


def limit_sized_stops(rng: random.Random) -> tuple[str, ...]:
    # over two letters, so that prefixes overlap and failure links go deep
    return tuple("".join(rng.choice("ab") for _ in range(MAX_STOP_STRING_CHARS))
                 for _ in range(MAX_STOP_STRINGS))


def test_memory_is_linear_in_the_total_stop_length():
    rng = random.Random(0)
    stop = limit_sized_stops(rng)
    text = "".join(rng.choice("ab") for _ in range(20_000))
    deltas = [text[i : i + 7] for i in range(0, len(text), 7)]
    # ~17 bytes a stop character: ~1.1 MB; a set of every prefix (the old matcher) took ~40 MB
    assert peak_memory_of(lambda: feed_all(StopStringMatcher(stop), deltas)) < 4 * 2**20


def test_a_long_stop_string_costs_linear_time_and_memory():
    # far past the request limit. 100k characters one at a time, twice nearly completing the stop
    # string, so that up to 50k characters are held; each "c" releases them all at once. The old
    # matcher's set of prefixes took 1.3 GB here, and copying the held text at each feed would be
    # billions of character operations.
    length = 50_000
    text = ("a" * (length - 1) + "c") * 2
    result = []
    started = time.perf_counter()
    peak = peak_memory_of(lambda: result.append(
        feed_all(StopStringMatcher(("a" * (length - 1) + "b",)), text)))
    assert time.perf_counter() - started < 5.0  # generous: < 1 s even with tracemalloc on
    assert peak < 4 * 2**20  # ~17 bytes a stop character, and the text itself
    assert result == [(text, False)]


def test_feeding_takes_amortized_constant_work_per_character(monkeypatch):
    # counts automaton edge look-ups: one per character, plus one per failure link followed,
    # which never exceeds the characters fed; whatever the number and length of stop strings
    rng = random.Random(1)
    stop = limit_sized_stops(rng)
    text = "".join(rng.choice("ab") for _ in range(100_000))
    deltas, start = [], 0
    while start < len(text):
        deltas.append(text[start : start + rng.choice([0, 1, 3, 8, 40])])
        start += len(deltas[-1])
    lookups = 0
    child = StopAutomaton.child

    def counting_child(self, node, code):
        nonlocal lookups
        lookups += 1
        return child(self, node, code)

    monkeypatch.setattr(StopAutomaton, "child", counting_child)
    assert feed_all(StopStringMatcher(stop), deltas) == (text, False)
    assert lookups <= 2 * len(text)
