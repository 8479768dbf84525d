"""Grammar state of the executor's constrained seqs: the model's tokenizer as llguidance sees it
(loaded on a thread from the start), matchers compiled on grammar threads and cached by grammar
text, one matcher per InputBatch row, and the token bitmask of the rows that sample. No gRPC.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

log = logging.getLogger(__name__)

_MAX_CACHED = 256  # compiled grammars kept (a template each; seqs get copies)
_FAILED = object()  # a row whose matcher could not be made


def hf_tokenizer(source: str):
    """The transformers tokenizer of `source` (an HF folder or a .gguf file: what Describe names,
    and what the scheduler loads)."""
    from transformers import PreTrainedTokenizerFast  # the executor's dependency, slow to import

    path = Path(source)
    if path.suffix == ".gguf":
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _load_tokenizer(source: str, vocab_size: int) -> llguidance.LLTokenizer:
    """hf_tokenizer(source) with its EOS, over the model's vocabulary (logits' width)."""
    hf = hf_tokenizer(source)
    return llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=vocab_size,
                                  eos_token=hf.eos_token_id)


class GrammarCompiler:
    """Compiles grammars on two threads (llguidance drops the GIL meanwhile), each once: a seq's
    matcher is a copy of its grammar's, fed with the seq's generated tokens on the same thread,
    so that a seq added to a step compiles while the step's forward runs."""

    def __init__(self, tokenizer_source: str, vocab_size: int,
                 load: Callable[[str, int], llguidance.LLTokenizer] = _load_tokenizer) -> None:
        self.words = -(-vocab_size // 32)  # int32 words of a row's bitmask
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self._tokenizer: Future | None = (self._pool.submit(load, tokenizer_source, vocab_size)
                                          if tokenizer_source else None)
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)))

    @property
    def available(self) -> bool:
        """Whether the model has a tokenizer (grammars need one) that did not fail to load."""
        loader = self._tokenizer
        return loader is not None and not (loader.done() and loader.exception() is not None)

    @property
    def eos_token_id(self) -> int:
        return self._tokenizer.result().eos_token

    def start(self, grammar: str, tokens: list[int]) -> Future:
        """A matcher of `grammar` that has consumed `tokens` (the seq's generated ones)."""
        return self._pool.submit(self._matcher, grammar, tokens)

    def _matcher(self, grammar: str, tokens: list[int]) -> llguidance.LLMatcher | None:
        try:
            return self._compile(grammar, tokens)
        except Exception:  # a tokenizer that failed to load: the seq ends at EOS (logged)
            log.exception("no matcher for a grammar")
            return None

    def _compile(self, grammar: str, tokens: list[int]) -> llguidance.LLMatcher:
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)
            with self._lock:
                self._templates[grammar] = template
                while len(self._templates) > _MAX_CACHED:
                    self._templates.popitem(last=False)
        matcher = template.deep_copy()
        if tokens:
            matcher.consume_tokens(tokens)
        return matcher

    def fill(self, matchers: list[llguidance.LLMatcher], bitmask: np.ndarray,
             index: list[int]) -> None:
        """bitmask[index[i]] := the tokens matchers[i] allows next; bitmask [n, words] int32."""
        if matchers:
            llg_numpy.fill_next_token_bitmask_par(self._executor, list(zip(matchers, index)),
                                                  bitmask)


class _RowGrammar:
    """A row's matcher (a future until its compile and replay are done) and the position in the
    seq of the next token it consumes."""

    __slots__ = ("future", "matcher", "next_position", "logged")

    def __init__(self, future: Future, next_position: int) -> None:
        self.future, self.matcher = future, None
        self.next_position = next_position
        self.logged = False


class GrammarRows:
    """The matchers of the rows whose seq follows a grammar. InputBatch adds and removes rows;
    the runner asks which sampling rows are constrained and for their bitmask."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._rows: dict[int, _RowGrammar] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def available(self) -> bool:
        return self.compiler is not None and self.compiler.available

    def add(self, row: int, grammar: str, generated: np.ndarray, num_tokens: int) -> None:
        """Row `row` follows `grammar`; `generated`: its seq's generated tokens, the last at
        position num_tokens - 1."""
        self._rows[row] = _RowGrammar(self.compiler.start(grammar, generated.tolist()),
                                      num_tokens)

    def remove(self, row: int) -> None:
        self._rows.pop(row, None)

    def clear(self) -> None:
        self._rows.clear()

    def constrained(self, rows: np.ndarray) -> np.ndarray:
        """[m] int64: the indices i of the rows[i] that follow a grammar."""
        if not self._rows:
            return np.zeros(0, dtype=np.int64)
        held = self._rows
        return np.array([i for i, row in enumerate(rows.tolist()) if row in held],
                        dtype=np.int64)

    def bitmask(self, rows: np.ndarray, positions: np.ndarray,
                tokens: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
        """[len(rows), words] int32: what each row may sample at positions[i]. Each matcher first
        consumes its seq's tokens up to there: tokens(row, start, end) gives them."""
        matchers = []
        for row, position in zip(rows.tolist(), positions.tolist()):
            state = self._rows[row]
            if state.matcher is None:
                state.matcher = state.future.result() or _FAILED
            if state.next_position < position:
                if state.matcher is not _FAILED and not state.matcher.is_stopped():
                    state.matcher.consume_tokens(
                        tokens(row, state.next_position, position).tolist())
                state.next_position = position
            matchers.append(state.matcher)
        bitmask = np.full((len(matchers), self.compiler.words), -1, dtype=np.int32)
        live = [(i, m) for i, m in enumerate(matchers) if m is not _FAILED]
        self.compiler.fill([m for _, m in live], bitmask, [i for i, _ in live])
        for i, (row, matcher) in enumerate(zip(rows.tolist(), matchers)):
            if matcher is _FAILED:
                self._end_with_eos(bitmask[i], row, "it did not compile")
            elif matcher.is_error():  # never from a masked token; from llguidance's own limits
                self._end_with_eos(bitmask[i], row, matcher.get_error())
        return bitmask

    def _end_with_eos(self, mask: np.ndarray, row: int, error: str) -> None:
        """A matcher in error allows nothing: the seq ends at EOS, and the error is logged once."""
        state = self._rows[row]
        if not state.logged:
            state.logged = True
            log.warning("a grammar failed; its seq ends at EOS: %s", error[:400])
        eos = self.compiler.eos_token_id
        mask[:] = 0
        mask[eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
