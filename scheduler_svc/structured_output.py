"""Structured output on the scheduler side: a request's format (JSON schema, any JSON object, regex,
choice, Lark/GBNF grammar) as llguidance grammar text, and the check that it compiles with the
model's tokenizer, on a thread within a time limit. Imports llguidance, never torch.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llg_numpy

from scheduler_svc.errors import InvalidArgument

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Bounds of what a client sends: a schema, regex or grammar up to 64 KiB (llguidance's own limits
# bound the work it causes), and a choice of up to 1,024 strings totalling as much.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
# The schema tool_choice "required" builds from every tool's parameters
MAX_TOOLS_SPEC_BYTES = 1 << 20
_MAX_ERROR_CHARS = 400  # of llguidance's message, which can quote the whole grammar
_MAX_REMEMBERED = 4096  # digests of grammars that compiled
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output format. `grammar` is llguidance's grammar text (what the executor
    compiles); `field` names the request field that set it, for error messages."""

    kind: str
    grammar: str
    field: str = "structured_output"


def structured_output(kind: str, value, field: str) -> StructuredOutput:
    """The format of `kind` (one of KINDS) from the client's value: a schema (dict or JSON text),
    a regex or grammar (text), choices (a list of strings), or nothing for json_object. Raises
    InvalidArgument naming `field` for a value of the wrong type, over the size bounds, or not
    parseable (a regex or grammar's syntax is checked by `GrammarChecker`)."""
    if kind == "json_object":
        return StructuredOutput(kind, _json_grammar('{"type":"object"}', field), field)
    if kind == "choice":
        return StructuredOutput(kind, _choice_grammar(value, field), field)
    if kind == "json":
        value = _schema_text(value, field)
    elif not isinstance(value, str):
        raise InvalidArgument(field, f"must be a string, got {type(value).__name__}")
    check_spec_size(value, field)
    if not value.strip():
        raise InvalidArgument(field, "must not be empty")
    if kind == "json":
        return StructuredOutput(kind, _json_grammar(value, field), field)
    try:
        grammar = llguidance.grammar_from(kind, value)
    except (ValueError, RecursionError) as err:
        raise InvalidArgument(field, _short(str(err))) from None
    return StructuredOutput(kind, grammar, field)


def tool_call_output(schema: dict, field: str) -> StructuredOutput:
    """The JSON schema a tool_choice builds from the tools (openai_protocol): each tool's
    parameters were bounded on their own, so the whole is bounded by MAX_TOOLS_SPEC_BYTES."""
    text = compact_json(schema, field)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TOOLS_SPEC_BYTES:
        raise InvalidArgument(field, f"the tools' schemas come to over {MAX_TOOLS_SPEC_BYTES} "
                              "bytes")
    return StructuredOutput("json", _json_grammar(text, field), field)


def _json_grammar(schema: str, field: str) -> str:
    """Compact JSON (no whitespace between tokens: a model cannot pad its output with
    whitespace until max_tokens, and the output is what json.dumps(separators=(",", ":"))
    writes)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
    except (ValueError, RecursionError) as err:
        raise InvalidArgument(field, _short(str(err))) from None


def _schema_text(schema, field: str) -> str:
    """A JSON schema as compact JSON text: an object (or true), from a dict or JSON text."""
    if isinstance(schema, str):
        check_spec_size(schema, field)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise InvalidArgument(field, "is not valid JSON") from None
    if not isinstance(schema, (dict, bool)) or schema is False:
        raise InvalidArgument(field, "must be a JSON schema object")
    return compact_json(schema, field)


def compact_json(value, field: str) -> str:
    """`value` as compact JSON text; InvalidArgument naming `field` if it has none."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError):
        raise InvalidArgument(field, "is nested too deeply or holds a non-finite number") from None


def _choice_grammar(choices, field: str) -> str:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidArgument(field, "must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidArgument(field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgument(field, "choices must be non-empty strings")
    check_spec_size("".join(choices), field)
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in choices))


def check_spec_size(text: str, field: str) -> None:
    """InvalidArgument naming `field` if `text` is over MAX_SPEC_BYTES in UTF-8 (a str has at
    least one byte per character: a longer one is refused without encoding it)."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise InvalidArgument(field, f"at most {MAX_SPEC_BYTES} bytes")


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


class GrammarChecker:
    """Compiles each new grammar once with the model's tokenizer (a matcher and its first mask,
    which builds the lexer: what the executor will do) on one of two grammar threads. llguidance
    drops the GIL while it compiles, so the event loop runs meanwhile; a grammar still compiling
    after `timeout_s` is refused (its thread finishes within llguidance's fuel limits)."""

    def __init__(self, hf_tokenizer, vocab_size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        # its build grows with the vocabulary, and so does the tokenizer's JSON it reads: once,
        # both off the loop
        self._tokenizer = self._pool.submit(
            lambda: llguidance.LLTokenizer(hf_tokenizer.backend_tokenizer.to_str(),
                                           n_vocab=vocab_size,
                                           eos_token=hf_tokenizer.eos_token_id))
        self._compiled: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    async def check(self, so: StructuredOutput) -> None:
        """Raises InvalidArgument naming so.field if the grammar does not compile, or not within
        the time limit."""
        digest = hashlib.sha256(so.grammar.encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            if digest in self._compiled:
                self._compiled.move_to_end(digest)
                return
        tokenizer = await asyncio.wrap_future(self._tokenizer)  # once; not the grammar's time
        future = asyncio.wrap_future(self._pool.submit(self._compile, tokenizer, so.grammar))
        try:
            error = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise InvalidArgument(so.field, f"did not compile within {self.timeout_s:g} s "
                                  "(--grammar-timeout): simplify it") from None
        if error:
            raise InvalidArgument(so.field, _short(error))
        with self._lock:
            self._compiled[digest] = None
            while len(self._compiled) > _MAX_REMEMBERED:
                self._compiled.popitem(last=False)

    @staticmethod
    def _compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> str:
        """llguidance's error for the grammar, "" if it compiles and has a first mask."""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            bitmask = llg_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        return matcher.get_error() if matcher.is_error() else ""

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
