"""Stop strings over a stream of text deltas: emit only text that cannot begin a stop string, and cut
the output where the first stop string completes. Must not import torch, cupy, grpc or protobuf code.
"""

import re
from array import array
from collections import deque


class StopAutomaton:
    """Aho-Corasick over the stop strings, in flat arrays (17 bytes a character): built in
    O(total length), advanced in amortized O(1) a character whatever the number of stop strings.
    Node 0 is the empty string; node q is a prefix of some stop string, `depth[q]` characters
    long, reached from its parent by the character `code[q]`.

    The characters a stop string does not share with an earlier one become consecutive nodes, so
    nearly every edge goes from q - 1 to q and costs one array entry; the few others (at most one
    per stop string) are in a dict. A dict per node would cost over 10x the memory.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.code = array("I", [0])  # ord() of the character on the edge into q
        self.from_prev = bytearray(1)  # 1 where q's parent is q - 1
        self.other_edges: dict[tuple[int, int], int] = {}  # (parent, code) -> child: the rest
        self.depth = array("i", [0])
        self.out = array("i", [0])  # length of the longest stop string ending q's prefix, or 0
        self._runs: list[tuple[int, int, int]] = []  # per insert: first node, its depth, last depth
        for s in stop:
            self._insert(s)
        self.fail = self._failure_links()

    def child(self, node: int, code: int) -> int | None:
        """The trie edge from `node` by the character `code`, if there is one."""
        nxt = node + 1
        if nxt < len(self.code) and self.code[nxt] == code and self.from_prev[nxt]:
            return nxt
        return self.other_edges.get((node, code))

    def step(self, node: int, char: str) -> int:
        """The node of the longest suffix of (node's prefix + char) that begins a stop string."""
        code = ord(char)
        while (nxt := self.child(node, code)) is None:
            if not node:
                return 0
            node = self.fail[node]
        return nxt

    def _insert(self, s: str) -> None:
        node, i = 0, 0
        while i < len(s) and (nxt := self.child(node, ord(s[i]))) is not None:
            node, i = nxt, i + 1
        if i < len(s):
            first = len(self.code)
            if node != first - 1:  # q - 1 is not the parent: the edge goes in the dict
                self.other_edges[(node, ord(s[i]))] = first
            self.from_prev.append(node == first - 1)
            self.from_prev.extend(b"\1" * (len(s) - i - 1))
            self.code.extend(map(ord, s[i:]))
            self.depth.extend(range(i + 1, len(s) + 1))
            self.out.extend(array("i", [0]) * (len(s) - i))
            self._runs.append((first, i + 1, len(s)))
            node = len(self.code) - 1
        self.out[node] = len(s)

    def _failure_links(self) -> array:
        """fail[q]: the node of the longest proper suffix of q's prefix that is in the trie. Nodes
        go by depth, so every link followed is already set; amortized O(1) a node."""
        fail = array("i", [0]) * len(self.code)
        code, out, from_prev, other = self.code, self.out, self.from_prev, self.other_edges
        parent = {child: node for (node, _), child in other.items()}
        for q in self._nodes_by_depth():
            node = q - 1 if from_prev[q] else parent[q]
            if node:  # self.step, inlined with self.child: this loop is most of the build time
                node, char = fail[node], code[q]
                while True:
                    nxt = node + 1
                    if nxt < len(code) and code[nxt] == char and from_prev[nxt]:
                        break
                    nxt = other.get((node, char))
                    if nxt is not None or not node:
                        break
                    node = fail[node]
                fail[q] = nxt or 0
            if not out[q]:
                out[q] = out[fail[q]]
        return fail

    def _nodes_by_depth(self):
        # each insert added one run of nodes of consecutive depths: walking the runs level by
        # level takes O(nodes) time and O(runs) memory (a sort of the nodes: O(nodes) memory)
        runs = sorted(self._runs, key=lambda run: run[1])
        active: list[tuple[int, int, int]] = []
        num_started = 0
        for depth in range(1, max((last for _, _, last in runs), default=0) + 1):
            while num_started < len(runs) and runs[num_started][1] == depth:
                active.append(runs[num_started])
                num_started += 1
            active = [run for run in active if run[2] >= depth]
            for first, first_depth, _ in active:
                yield first + depth - first_depth


class _Unemitted:
    """Text not emitted yet, kept as the deltas it came in: appending and taking from the front
    cost what is appended or taken, never a copy of the rest (held text may be long, deltas short).
    """

    def __init__(self) -> None:
        self._pieces: deque[str] = deque()
        self._start = 0  # characters of the first piece already taken
        self.num_chars = 0

    def append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self.num_chars += len(text)

    def take(self, n: int) -> str:
        """Removes and returns the first `n` characters."""
        self.num_chars -= n
        taken = []
        while n:
            piece, start = self._pieces[0], self._start
            if len(piece) - start > n:
                taken.append(piece[start : start + n])
                self._start += n
                break
            taken.append(piece[start:] if start else piece)
            self._pieces.popleft()
            self._start, n = 0, n - (len(piece) - start)
        if self._pieces and self._start * 2 > len(self._pieces[0]):
            # a long delta mostly taken would stay alive for its few held characters: copy those,
            # fewer than the characters taken from it, so memory stays within twice what is held
            self._pieces[0], self._start = self._pieces[0][self._start :], 0
        return "".join(taken)


def _any_char_of(chars) -> re.Pattern:
    # one C-level scan finds where the next stop string may start; "(?!)" never matches
    return re.compile("[" + "".join(map(re.escape, chars)) + "]" if chars else "(?!)")


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
        self._automaton = StopAutomaton(self.stop)
        self._starts = _any_char_of({s[0] for s in self.stop})
        # the automaton's node for the text so far: its depth is how much is held back, so `_held`
        # is always shorter than the longest stop string
        self._node = 0
        self._held = _Unemitted()
        self.matched = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text that may be emitted now, and whether a stop string has completed."""
        if self.matched:
            return "", True
        num_before = self._held.num_chars
        match = self._scan(delta)
        if match is None and not self._node and not num_before:
            return delta, False  # nothing held before or after: the usual case, and no copy
        self._held.append(delta)
        if match is not None:
            end, length = match
            text = self._held.take(num_before + end - length)
            self._held, self.matched = _Unemitted(), True
            return text, True
        return self._held.take(self._held.num_chars - self._automaton.depth[self._node]), False

    def flush(self) -> str:
        """At the end of the output: release what was held back (none of it completes a stop string)."""
        held, self._held, self._node = self._held, _Unemitted(), 0
        return "" if self.matched else held.take(held.num_chars)

    def _scan(self, delta: str) -> tuple[int, int] | None:
        """Advances over `delta`: (end in delta, length) of the first stop string to complete, or
        None. The automaton's `out` is the longest one ending there, i.e. the earliest-starting."""
        automaton, node, pos = self._automaton, self._node, 0
        while pos < len(delta):
            if not node:  # at the root, characters before the next possible start change nothing
                start = self._starts.search(delta, pos)
                if start is None:
                    break
                pos = start.start()
            node = automaton.step(node, delta[pos])
            pos += 1
            if automaton.out[node]:
                self._node = node
                return pos, automaton.out[node]
        self._node = node
        return None
