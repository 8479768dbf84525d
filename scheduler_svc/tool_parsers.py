"""Tool calls in a chat completion's text, found as it streams in: the model families' own formats
(Llama 3.x JSON, Hermes / Qwen `<tool_call>` tags, SmolLM2's list in those tags) and the JSON that
`required` and named tool choices enforce. Plain Python: no HTTP, no torch."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

_TOOL_CALL_TAG = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.x's; a special token, so usually not in the text
_ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes parameters, Hermes arguments
_WHITESPACE = " \t\n\r"


def new_tool_call_id() -> str:
    """vLLM's form of a tool call's id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """What a stretch of text adds to one call: its id and name the first time, then fragments of
    its arguments, which add up to the model's own JSON text of them."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def merge(self, later: ToolCallDelta) -> None:
        self.id, self.name = self.id or later.id, self.name or later.name
        self.arguments += later.arguments


@dataclass
class ParsedText:
    """What a stretch of text adds to a choice: content, and tool call deltas (one per call)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _JsonCall:
    """One `{"name": ..., "arguments" | "parameters": ...}` object scanned a character at a time,
    once: a JSON lexer that follows only strings and depth, and notes where the top-level values
    lie. Lenient by design (what the model wrote is what it gets); a call without a string name is
    no call."""

    def __init__(self, start: int) -> None:
        self.pos = start  # the next character to scan
        self.depth = 0
        self.in_string = self.escape = False
        self.expect = "open"  # at depth 1: key, colon, value, in_value, comma
        self.key: str | None = None
        self.key_start = self.value_start = 0
        self.name: str | None = None
        self.args_start: int | None = None  # of the arguments' value, once it begins
        self.args_end: int | None = None
        self.done = False

    def scan(self, text: str) -> None:
        """Scans text[self.pos:], stopping after the object's closing brace."""
        while self.pos < len(text) and not self.done:
            self._step(text, text[self.pos])
            self.pos += 1

    def _step(self, text: str, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_end(text)
        elif c == '"':
            self.in_string = True
            if self.depth == 1 and self.expect == "value":
                self._begin(self.pos)
            elif self.depth == 1 and self.expect == "key":
                self.key_start = self.pos
        elif c in "{[":
            if self.depth == 1 and self.expect == "value":
                self._begin(self.pos)
            self.expect = "key" if self.depth == 0 else self.expect
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.expect == "in_value":  # a nested value closed
                self._end(text, self.pos + 1)
            elif self.depth == 0:
                if self.expect == "in_value":  # a number or literal ends at the brace
                    self._end(text, self.pos)
                self.done = True
        elif self.depth == 1:
            self._top_level(text, c)

    def _top_level(self, text: str, c: str) -> None:
        """A character outside strings at depth 1: separators, and numbers or literals."""
        if self.expect == "colon" and c == ":":
            self.expect = "value"
        elif self.expect == "in_value" and (c == "," or c in _WHITESPACE):
            self._end(text, self.pos)
            self.expect = "key" if c == "," else "comma"
        elif self.expect == "comma" and c == ",":
            self.expect = "key"
        elif self.expect == "value" and c not in _WHITESPACE:
            self._begin(self.pos)

    def _string_end(self, text: str) -> None:
        if self.expect == "key":
            self.key = _loads(text[self.key_start:self.pos + 1])
            self.expect = "colon"
        elif self.expect == "in_value":
            self._end(text, self.pos + 1)

    def _begin(self, start: int) -> None:
        self.value_start, self.expect = start, "in_value"
        if self.key in _ARGUMENT_KEYS and self.args_start is None:
            self.args_start = start

    def _end(self, text: str, end: int) -> None:
        self.expect = "comma"
        if self.args_start == self.value_start and self.args_end is None:
            self.args_end = end
        elif self.key == "name" and self.name is None:
            name = _loads(text[self.value_start:end])
            self.name = name if isinstance(name, str) and name else None


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


@dataclass
class _Call:
    """A call as it is emitted: its scan, index and id once named, and how much of its arguments
    have gone out."""

    scan: _JsonCall
    index: int | None = None
    id: str | None = None
    args_sent: int = 0
    args_done: bool = False


class ToolCallStream:
    """Text in (`feed`, then `finish`), content and tool call deltas out. Content is the text
    before the first call's marker, streamed as it comes but for what could begin a marker; once a
    call is named, no more content: text between and after calls is dropped (vLLM's). Text that
    never yields a named call is content at the end. Subclasses find the calls (`_advance`)."""

    calls_finish_reason = "tool_calls"  # of a choice that ends ("stop") having called a tool
    empty_content = None  # the message's content beside calls when no text came before them

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.text = ""
        self.calls: list[_Call] = []
        self._open = 0  # calls before it have nothing more to send
        self.num_named = 0
        self._content_end = 0  # content is text[:_content_end], until a call is named
        self._content_sent = 0
        self.finished = False

    def feed(self, text: str) -> ParsedText:
        self.text += text
        self._advance()
        return self._emit()

    def finish(self, text: str = "") -> ParsedText:
        """The last text: whatever was held back goes out now."""
        self.text += text
        self._advance()
        self.finished = True
        out = self._emit()
        if self.num_named == 0:  # no call after all: the text held back is content
            self._content_end = len(self.text)
            out.content += self._emit().content
        return out

    def _advance(self) -> None:
        raise NotImplementedError

    def _scan_call(self) -> bool:
        """Scans the newest call further; True once it is done."""
        call = self.calls[-1].scan
        call.scan(self.text)
        return call.done

    def _emit(self) -> ParsedText:
        out = ParsedText()
        if self._content_end > self._content_sent:
            out.content = self.text[self._content_sent:self._content_end]
            self._content_sent = self._content_end
        for call in self.calls[self._open:]:
            delta = self._call_delta(call)
            if delta is not None and (self.parallel or delta.index == 0):
                out.tool_calls.append(delta)
        while self._open < len(self.calls) and self._closed(self.calls[self._open]):
            self._open += 1
        return out

    @staticmethod
    def _closed(call: _Call) -> bool:
        return call.args_done or call.scan.done and call.scan.name is None

    def _call_delta(self, call: _Call) -> ToolCallDelta | None:
        scan = call.scan
        if call.index is None:
            if scan.name is None:
                return None
            if self.num_named == 0:
                self._content_end = min(self._content_end, self._content_sent)
            call.index, call.id = self.num_named, new_tool_call_id()
            self.num_named += 1
            delta = ToolCallDelta(call.index, call.id, scan.name)
        else:
            delta = ToolCallDelta(call.index)
        delta.arguments = self._arguments(call)
        return delta if delta.id or delta.arguments else None

    def _arguments(self, call: _Call) -> str:
        """The arguments' text not sent yet: as written, or a JSON string's value once complete
        (some models write them as a string holding JSON); "{}" for a call that has none."""
        scan = call.scan
        if call.args_done:
            return ""
        if scan.args_start is None:
            call.args_done = scan.done
            return "{}" if scan.done else ""
        end = scan.args_end if scan.args_end is not None else scan.pos
        if self.text[scan.args_start] == '"':
            if scan.args_end is None and not self.finished:
                return ""
            call.args_done = True
            value = _loads(self.text[scan.args_start:end])
            return value if isinstance(value, str) else self.text[scan.args_start:end]
        fragment = self.text[scan.args_start + call.args_sent:end]
        call.args_sent += len(fragment)
        call.args_done = scan.args_end is not None
        return fragment


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


class _CallList:
    """The states shared by formats whose calls are JSON objects in a row: in a `[...]` list
    (separated by commas) or bare (separated by `;` or whitespace)."""

    def __init__(self, stream: ToolCallStream, bracketed: bool) -> None:
        self.stream = stream
        self.separators = _WHITESPACE + ("," if bracketed else ";")
        self.in_call = False

    def advance(self, pos: int) -> tuple[int, bool]:
        """Scans from `pos`; returns where it stopped and whether the list ended (its closing
        bracket, or anything that is not a call)."""
        stream, text = self.stream, self.stream.text
        while True:
            if self.in_call:
                if not stream._scan_call():
                    return len(text), False
                self.in_call = False
                pos = stream.calls[-1].scan.pos
            while pos < len(text) and text[pos] in self.separators:
                pos += 1
            if pos == len(text):
                return pos, False
            if text[pos] != "{":
                return pos + 1, True  # "]", or text that is no call
            stream.calls.append(_Call(_JsonCall(pos)))
            self.in_call = True


class HermesToolCalls(ToolCallStream):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, once or more (Hermes, Qwen 2.5 /
    3); SmolLM2 writes a list of such objects inside one tag: both are read."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._pos = 0
        self._list: _CallList | None = None  # inside a tag
        self._content_open = True  # until the first tag

    def _advance(self) -> None:
        text = self.text
        while True:
            if self._list is not None:
                self._pos, ended = self._list.advance(self._pos)
                if not ended:
                    return
                self._list = None
            start = text.find(_TOOL_CALL_TAG, self._pos)
            if start < 0:
                if self._content_open:
                    self._content_end = len(text) - _held(text, _TOOL_CALL_TAG)
                self._pos = max(self._pos, len(text) - len(_TOOL_CALL_TAG) + 1)
                return
            if self._content_open:
                self._content_end, self._content_open = start, False
            self._pos = _skip_whitespace(text, start + len(_TOOL_CALL_TAG))
            if self._pos == len(text):
                self._pos = start  # wait for what follows the tag
                return
            bracketed = text[self._pos] == "["
            self._list = _CallList(self, bracketed)
            self._pos += bracketed


class Llama3JsonToolCalls(ToolCallStream):
    """Llama 3.x: text that starts (after `<|python_tag|>`, when it is kept) with
    `{"name": ..., "parameters": ...}` objects separated by `;`; any other text is content."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._state = "start"
        self._pos = 0
        self._list = _CallList(self, bracketed=False)

    def _advance(self) -> None:
        text = self.text
        if self._state == "start":
            self._pos = _skip_whitespace(text, self._pos)
            if text.startswith(_PYTHON_TAG, self._pos):
                self._pos = _skip_whitespace(text, self._pos + len(_PYTHON_TAG))
            rest = text[self._pos:self._pos + len(_PYTHON_TAG)]
            if not rest or len(rest) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(rest):
                return  # not known yet
            self._state = "calls" if rest[0] == "{" else "content"
        if self._state == "content":
            self._content_end = len(text)
        elif self._state == "calls":
            self._pos, ended = self._list.advance(self._pos)
            if ended:
                self._state = "after"  # the rest is ignored, as vLLM does


class RequiredToolCalls(ToolCallStream):
    """What tool_choice "required" enforces: `[{"name": ..., "parameters": ...}, ...]`."""

    empty_content = ""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._pos = 0
        self._list: _CallList | None = None
        self._ended = False

    def _advance(self) -> None:
        if self._ended:
            return
        if self._list is None:
            self._pos = _skip_whitespace(self.text, self._pos)
            if self._pos == len(self.text):
                return
            if self.text[self._pos] != "[":
                self._ended = True
                return
            self._list, self._pos = _CallList(self, bracketed=True), self._pos + 1
        self._pos, self._ended = self._list.advance(self._pos)


class NamedToolCall(ToolCallStream):
    """What a named tool_choice enforces: the text is the one call's arguments."""

    calls_finish_reason = "stop"  # OpenAI's and vLLM's after a named call
    empty_content = ""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.call_id = new_tool_call_id()
        self._sent = 0

    def _advance(self) -> None:
        pass

    def _emit(self) -> ParsedText:
        first = self.num_named == 0
        if not first and self._sent == len(self.text):
            return ParsedText()
        if first and not self.text and not self.finished:
            return ParsedText()
        delta = ToolCallDelta(0, self.call_id if first else None, self.name if first else None,
                              self.text[self._sent:])
        self.num_named, self._sent = 1, len(self.text)
        return ParsedText(tool_calls=[delta])

    def finish(self, text: str = "") -> ParsedText:
        self.text += text
        self.finished = True
        return self._emit()


# --tool-call-parser choices (vLLM's names): hermes also serves SmolLM2 and Qwen 2.5 / 3
PARSER_CLASSES = {"hermes": HermesToolCalls, "llama3_json": Llama3JsonToolCalls}
TOOL_CALL_PARSERS = tuple(PARSER_CLASSES)
