"""The engine's output side (vLLM v1's OutputProcessor): each request's mailbox and per-sample
state, and a step's tokens turned into stream events (detokenized, stop strings applied). Never
calls the scheduler: it returns the seqs it ended, and the engine frees them there."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.metrics import Metrics
from scheduler_svc.plan import SeqUpdate
from scheduler_svc.request import FinishEvent, TokenEvent
from scheduler_svc.sampling_params import TokenLogprobs
from scheduler_svc.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)

# Streams a step may wake before the adaptive stream interval batches their tokens: each wake is
# a write on the event loop, which also plans the next step.
STREAMS_PER_STEP = 256


def stream_interval(config_interval: int, num_sampled: int) -> int:
    """Steps between hand-overs of a stream's tokens in a step that sampled `num_sampled`."""
    if config_interval > 0:
        return config_interval
    return max(1, -(-num_sampled // STREAMS_PER_STEP))


class EngineFailed(Exception):
    """The step loop failed unexpectedly and ended this request; mapped to INTERNAL."""


class RequestFailed(EngineFailed):
    """Something this request alone caused failed (a value the executor link cannot carry or the
    executor refuses, its detokenizing): it was ended, the others go on. INTERNAL."""


class Mailbox:
    """A request's events (all its samples'), taken by its reader in batches. Putting wakes the
    reader only when asked to: tokens can wait for the next hand-over, an end never does.

    The step loop puts into every stream's mailbox each step, so a put costs one future's result
    at most (no asyncio.Event), and a reader that comes back to items already woken for takes
    them without suspending."""

    __slots__ = ("_items", "_woken", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._woken = False  # a put asked to wake the reader since its last take
        self._waiter: asyncio.Future | None = None  # the reader, while it waits

    def put(self, item, wake: bool = True) -> None:
        self._items.append(item)
        if wake and not self._woken:
            self._woken = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def take(self) -> list:
        """Every item put so far (at least one), once a put woke the reader."""
        if not self._woken:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._woken = False
        items, self._items = self._items, []
        return items

    async def batches(self, num_samples: int) -> AsyncIterator[list[TokenEvent | FinishEvent]]:
        """What take() returns, until each of the request's samples has put its FinishEvent; an
        exception put raises, once the events put before it are handed over."""
        while num_samples:
            events = await self.take()
            if not all(type(e) is TokenEvent for e in events):  # rarely: an end in it
                failed = next((e for e in events if isinstance(e, Exception)), None)
                if failed is not None:
                    if events[0] is not failed:
                        yield events[:events.index(failed)]
                    raise failed
                num_samples -= sum(isinstance(e, FinishEvent) for e in events)
            yield events


class RequestState:
    """One sample's output side: the request's mailbox (shared by its n samples), the sample's
    detokenizer and stop-string matcher."""

    def __init__(self, seq: Sequence, tokenizer, stopper, request_id: str,
                 mailbox: Mailbox, sample_index: int = 0) -> None:
        self.seq = seq
        self.request_id = request_id
        self.sample_index = sample_index
        self.mailbox = mailbox
        self.unsent = 0  # tokens put without waking the reader
        self.detokenizer = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
                            if tokenizer is not None else None)
        self.stopper = stopper
        self.arrival_time = time.monotonic()
        self.last_token_time: float | None = None
        self.finished = False

    def text_for(self, token_id: int) -> tuple[str, bool]:
        """The text delta this token releases, and whether a stop string matched."""
        text = self.detokenizer.step(token_id) if self.detokenizer else ""
        if self.stopper is None:
            return text, False
        return self.stopper.feed(text)

    def flush(self) -> str:
        text = self.detokenizer.flush() if self.detokenizer else ""
        if self.stopper is None:
            return text
        emitted, matched = self.stopper.feed(text)
        return emitted if matched else emitted + self.stopper.flush()


class OutputProcessor:
    """The open requests' output states, by seq_id. Every method that ends a request returns
    the (seq_id, reason) pairs the scheduler must finish; none of them calls it."""

    def __init__(self, metrics: Metrics, stream_interval_steps: int = 0) -> None:
        self.metrics = metrics
        self.stream_interval = stream_interval_steps
        self.requests: dict[int, RequestState] = {}
        self.idle = asyncio.Event()  # set while no request is open
        self.idle.set()

    def add_request(self, request_id: str, seqs: list[Sequence], stoppers, tokenizer
                    ) -> list[RequestState]:
        """One state per sample, sharing one mailbox."""
        mailbox = Mailbox()
        states = [RequestState(seq, tokenizer, stopper, request_id, mailbox, i)
                  for i, (seq, stopper) in enumerate(zip(seqs, stoppers))]
        for state in states:
            self.requests[state.seq.seq_id] = state
        self.idle.clear()
        return states

    def process_outputs(self, updates: list[SeqUpdate],
                        logprobs: dict[int, TokenLogprobs] | None
                        ) -> list[tuple[int, FinishReason]]:
        """A step's tokens to their streams, and to the latency metrics once for the step.
        Returns the seqs this ended that the scheduler has not: a stop string's, and every
        sample of a request whose output failed (it alone ends)."""
        now = time.monotonic()
        interval = stream_interval(self.stream_interval, len(updates))
        ttfts: list[float] = []
        itls: list[float] = []
        to_finish: list[tuple[int, FinishReason]] = []
        for update in updates:
            state = self.requests.get(update.seq.seq_id)
            if state is None:  # aborted while its step was in flight
                continue
            if state.last_token_time is None:
                ttfts.append(now - state.arrival_time)
            else:
                itls.append(now - state.last_token_time)
            try:
                if self._emit(state, update, now, interval,
                              logprobs.get(update.seq.seq_id) if logprobs else None):
                    to_finish.append((update.seq.seq_id, FinishReason.STOP_STRING))
            except Exception as err:  # noqa: BLE001 - one request's output: it alone ends
                log.error("request %s: its output failed", state.request_id, exc_info=err)
                to_finish += self.fail_request(
                    state, f"producing its output failed ({type(err).__name__})")
        self.metrics.generated_tokens.inc(len(ttfts) + len(itls))
        self.metrics.ttft.observe_many(ttfts)
        self.metrics.itl.observe_many(itls)
        return to_finish

    def _emit(self, state: RequestState, update: SeqUpdate, now: float, interval: int,
              logprobs: TokenLogprobs | None) -> bool:
        """Puts one token's event; True when a stop string matched (the request is finished
        here, the scheduler is not told)."""
        first = state.last_token_time is None
        state.last_token_time = now
        text, matched = state.text_for(update.token_id)
        state.unsent += 1
        wake = first or state.unsent >= interval
        if wake:
            state.unsent = 0
        index = update.seq.num_output_tokens - 1
        state.mailbox.put(TokenEvent(update.token_id, text, index, logprobs, state.sample_index),
                          wake)
        if matched:
            self.finish(state, FinishReason.STOP_STRING, tail="")
        elif update.finish_reason is not None:
            self.finish(state, update.finish_reason)
        return matched

    def finish(self, state: RequestState, reason: FinishReason, tail: str | None = None) -> None:
        """Ends one sample's stream with its FinishEvent (the text held back, unless `tail`)."""
        if tail is None:
            tail = state.flush()
        self._forget(state)
        self.metrics.requests_finished.labels(reason.name.lower()).inc()
        elapsed = time.monotonic() - state.arrival_time
        self.metrics.e2e.observe(elapsed)
        seq = state.seq
        log.debug("request %s finished (%s): %d prompt + %d generated tokens in %.2fs",
                  state.request_id, reason.name.lower(), seq.num_prompt_tokens,
                  seq.num_output_tokens, elapsed)
        state.mailbox.put(FinishEvent(reason, seq.num_prompt_tokens, seq.num_output_tokens, tail,
                                      state.sample_index))

    def finish_all(self, reason: FinishReason) -> list[tuple[int, FinishReason]]:
        """Ends every stream with its FinishEvent (shutdown)."""
        states = list(self.requests.values())
        for state in states:
            self.finish(state, reason)
        return [(state.seq.seq_id, reason) for state in states]

    def abort(self, state: RequestState) -> list[tuple[int, FinishReason]]:
        """The reader left: the sample ends without an event."""
        self._forget(state)
        self.metrics.requests_finished.labels("cancelled").inc()
        log.debug("request %s cancelled after %d tokens", state.request_id,
                  state.seq.num_output_tokens)
        return [(state.seq.seq_id, FinishReason.ABORTED)]

    def fail_request(self, state: RequestState, reason: str) -> list[tuple[int, FinishReason]]:
        """Ends every sample of `state`'s request with RequestFailed; nothing else changes."""
        failure = RequestFailed(f"request {state.request_id} failed and was ended: {reason}")
        samples = [s for s in self.requests.values() if s.mailbox is state.mailbox]
        for sample in samples:
            self._forget(sample)
            self.metrics.requests_finished.labels("error").inc()
        state.mailbox.put(failure)
        return [(sample.seq.seq_id, FinishReason.ABORTED) for sample in samples]

    def fail_seqs(self, seq_ids: Iterable[int], cause: Exception) -> list[tuple[int, FinishReason]]:
        """Ends the requests of `seq_ids`, named by a lost executor link as what failed a step."""
        to_finish: list[tuple[int, FinishReason]] = []
        for seq_id in seq_ids:
            state = self.requests.get(seq_id)
            if state is not None:
                log.error("request %s (seq %d) ended: it failed the step (%s); the others are "
                          "recomputed", state.request_id, seq_id, cause)
                to_finish += self.fail_request(
                    state, f"the executor link failed on it: {str(cause)[:300]}")
        return to_finish

    def fail_all(self, error: Exception) -> list[tuple[int, FinishReason]]:
        """Ends every stream with `error` (no executor, a failed step loop)."""
        states = list(self.requests.values())
        for state in states:
            self._forget(state)
            state.mailbox.put(error)
        return [(state.seq.seq_id, FinishReason.ABORTED) for state in states]

    def _forget(self, state: RequestState) -> None:
        state.finished = True
        self.requests.pop(state.seq.seq_id, None)
        if not self.requests:
            self.idle.set()
