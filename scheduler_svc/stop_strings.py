"""Stop strings over a stream of text deltas: emit only text that cannot begin a stop string, and cut
the output where the first stop string completes. Must not import torch, cupy, grpc or protobuf code.
"""


class StopStringMatcher:
    """Fed the detokenizer's deltas, returns `(text_to_emit, matched)`.

    It holds back the longest suffix of the unemitted text that is a proper prefix of some stop
    string, so emitted text never has to be taken back. "First" stop string means the occurrence
    that completes first while reading left to right (among those, the one starting earliest), as a
    stream sees it and as vLLM does: with stops ("abcd", "bc") the text "abcd" stops at "a".
    The stop string and everything after it are never emitted.
    """

    def __init__(self, stop: tuple[str, ...]):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        # every proper prefix of every stop string: the suffixes worth holding back
        self._prefixes = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._max_held = max((len(s) - 1 for s in self.stop), default=0)
        self._held = ""
        self.matched = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text that may be emitted now, and whether a stop string has completed."""
        if self.matched:
            return "", True
        text = self._held + delta
        match_start = self._first_match_start(text)
        if match_start is not None:
            self._held, self.matched = "", True
            return text[:match_start], True
        num_held = self._num_to_hold(text)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        """At the end of the output: release what was held back (none of it completes a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched else held

    def _first_match_start(self, text: str) -> int | None:
        # the occurrence ending first; for equal ends, the longer one (starting first)
        best: tuple[int, int] | None = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _num_to_hold(self, text: str) -> int:
        for n in range(min(len(text), self._max_held), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0
