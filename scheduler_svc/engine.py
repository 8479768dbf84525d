"""The scheduler service's engine: requests in, one step plan per step out to the executor,
sampled tokens back to each request's stream (detokenized, stop strings applied).

Owns the Scheduler, the tokenizer and the per-request output queues. Plain asyncio; no gRPC types.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.executor_client import ExecutorClient, ExecutorLost
from scheduler_svc.metrics import Metrics
from scheduler_svc.plan import SeqUpdate, StepPlan
from scheduler_svc.request import (FinishEvent, GenerateSpec, ModelLimits, TokenEvent,
                                   resolve_prompt, validate_params)
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.stop_strings import StopStringMatcher
from scheduler_svc.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at --max-waiting; mapped to RESOURCE_EXHAUSTED."""


class NoExecutor(Exception):
    """No executor has been reachable for longer than the grace period; mapped to UNAVAILABLE."""


class ShuttingDown(Exception):
    """The service is draining before it stops; mapped to UNAVAILABLE."""


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    max_waiting: int = 4096
    unavailable_grace_s: float = 30.0
    # Steps sent before the oldest one's result is back: 2 lets the scheduler plan step N+1
    # while the executor runs step N (async scheduling); 1 is lockstep.
    max_steps_in_flight: int = 2


class _RequestState:
    """One request's output side: its queue, detokenizer and stop-string matcher."""

    def __init__(self, seq: Sequence, tokenizer, stop: tuple[str, ...]) -> None:
        self.seq = seq
        self.queue: asyncio.Queue[TokenEvent | FinishEvent] = asyncio.Queue()
        self.detokenizer = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
                            if tokenizer is not None else None)
        self.stopper = StopStringMatcher(stop) if stop else None
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


class Engine:
    """Continuous batching over one executor link, with resync when the executor is lost."""

    def __init__(self, config: EngineConfig, client: ExecutorClient,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics or Metrics()
        self.scheduler: Scheduler | None = None
        self.tokenizer = None
        self.limits: ModelLimits | None = None
        self._tokenizer_source: str | None = None
        self._requests: dict[int, _RequestState] = {}
        self._seq_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._draining = False
        self._switch: tuple[ExecutorClient, object, asyncio.Future] | None = None
        self._switch_requested = asyncio.Event()
        self.attached = False
        self.on_attached_change = None  # callable(bool): health reporting hooks in here
        self.num_resyncs = 0
        self.num_steps = 0

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Attaches the first executor, then runs the step loop in the background."""
        await self._attach(await self.client.connect())
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    def start_draining(self) -> None:
        """Stops admission: new requests get UNAVAILABLE, running ones go on."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self._idle.wait()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    async def stop(self) -> None:
        if self._task is not None:
            # Cancel until it takes: asyncio.wait_for (Python < 3.12) can swallow a cancellation
            # that lands as the awaited stream read completes, and the loop would run on.
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()

    async def _attach(self, description) -> None:
        """Sizes the block pools from Describe's answer (never from a guess) and loads the tokenizer."""
        if description.tokenizer != self._tokenizer_source:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, description.tokenizer)
            self._tokenizer_source = description.tokenizer
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.limits = ModelLimits(description.vocab_size, description.max_model_len, eos)
        block_manager = BlockManager(description.block_size, description.num_gpu_blocks,
                                     description.num_cpu_blocks)
        if self.scheduler is None:
            self.scheduler = Scheduler(self.config.scheduler, block_manager)
        else:  # the caller has reset the scheduler: nothing is mapped on the old pools
            self.scheduler.block_manager = block_manager
        self._set_attached(True)

    def _set_attached(self, attached: bool) -> None:
        self.attached = attached
        if self.on_attached_change is not None:
            self.on_attached_change(attached)

    # --- planned executor replacement -----------------------------------------------------------

    async def switch_executor(self, addresses: list[str]) -> tuple[str, str, int]:
        """Moves serving to the first of `addresses` that serves the same model; the unfinished
        sequences are recomputed there. Returns (address, model name, sequences moved)."""
        old = self.client
        client = ExecutorClient(addresses, step_timeout_s=old.step_timeout_s,
                                describe_timeout_s=old.describe_timeout_s,
                                max_backoff_s=old.max_backoff_s, security=old.security,
                                fingerprint=old.fingerprint)
        description = await client.connect_once()
        if description is None:
            await client.close()
            raise InvalidArgument("addresses", f"no executor serving fingerprint {old.fingerprint} "
                                  f"answered at {', '.join(addresses)}")
        done = asyncio.get_running_loop().create_future()
        self._switch = (client, description, done)
        self._switch_requested.set()
        self._wakeup.set()
        return await done

    async def _apply_switch(self) -> None:
        """Between steps: the new client replaces the old, all executor-side state is rebuilt."""
        client, description, done = self._switch
        self._switch = None
        self._switch_requested.clear()
        old, self.client = self.client, client
        moved = self.scheduler.num_running + self.scheduler.num_swapped
        self.scheduler.reset_executor()
        await self._attach(description)
        await old.close()
        log.info("serving moved to executor %s; %d sequences recomputed there",
                 client.connected_address, moved)
        done.set_result((client.connected_address, description.model_name, moved))

    # --- requests -------------------------------------------------------------------------------

    def _admit(self, spec: GenerateSpec) -> _RequestState:
        """Validates and queues one request; raises InvalidArgument, QueueFull, NoExecutor or
        ShuttingDown."""
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        if self.scheduler is None:
            raise NoExecutor("no executor attached yet")
        lost_since = self.client.disconnected_since
        if lost_since is not None and time.monotonic() - lost_since > self.config.unavailable_grace_s:
            raise NoExecutor("no executor reachable for "
                             f"{time.monotonic() - lost_since:.0f}s")
        prompt_ids = resolve_prompt(spec, self.tokenizer, self.limits)
        validate_params(spec, self.limits)
        if spec.stopping.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "this model has no tokenizer; use stop_token_ids")
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFull(f"{self.scheduler.num_waiting} requests are waiting")
        seq = Sequence(next(self._seq_ids), prompt_ids, spec.sampling, spec.stopping,
                       self.limits.eos_token_id, self.limits.max_model_len)
        self._check_fits(seq)
        self.scheduler.add_seq(seq)  # assigns a seed if none was given: recomputes sample alike
        state = _RequestState(seq, self.tokenizer, spec.stopping.stop)
        self._requests[seq.seq_id] = state
        self._idle.clear()
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        self._wakeup.set()
        return state

    def _check_fits(self, seq: Sequence) -> None:
        """An explicit max_tokens must fit in the whole KV cache; without one, the cache's size
        caps the output (finish reason LENGTH)."""
        if seq.stopping.max_tokens is None:
            needed, what = seq.num_prompt_tokens + 1, "prompt"
        else:
            needed, what = seq.num_prompt_tokens + seq.max_tokens, "max_tokens"
        if not self.scheduler.can_ever_fit(needed):
            raise InvalidArgument(
                what, f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens "
                f"({seq.max_tokens}) can never fit in the KV cache")

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Token events, then one FinishEvent. Leaving early (cancel, disconnect) aborts the request."""
        state = self._admit(spec)
        try:
            while True:
                event = await state.queue.get()
                yield event
                if isinstance(event, FinishEvent):
                    return
        finally:
            if not state.finished:
                self._abort(state)

    def _abort(self, state: _RequestState) -> None:
        state.finished = True
        self._forget(state)
        self.scheduler.abort_seq(state.seq.seq_id)
        self.metrics.requests_finished.labels("cancelled").inc()
        self.metrics.observe_scheduler(self.scheduler)
        self._wakeup.set()

    def _forget(self, state: _RequestState) -> None:
        self._requests.pop(state.seq.seq_id, None)
        if not self._requests:
            self._idle.set()

    def abort_all(self, reason: FinishReason = FinishReason.ABORTED) -> None:
        """Ends every request now (shutdown): each stream gets its FinishEvent."""
        for state in list(self._requests.values()):
            self.scheduler.abort_seq(state.seq.seq_id)
            self._finish(state, reason)
        self._wakeup.set()

    # --- the step loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        """Keeps up to max_steps_in_flight plans sent. When the oldest result comes back it is
        applied, the next plan goes out, and only then are that result's tokens detokenized and
        streamed, so the executor always has a step queued while the host works."""
        in_flight: deque[StepPlan] = deque()
        while True:
            try:
                await self._fill(in_flight)
                if not in_flight:
                    await self._wait_for_work()
                    continue
                sampled = await self.client.receive(in_flight[0])
                updates = self.scheduler.update_from_output(in_flight.popleft(), sampled)
                self.num_steps += 1
                try:
                    await self._fill(in_flight)
                finally:
                    for update in updates:
                        self._emit(update)
                    self.metrics.steps.inc()
                    self.metrics.observe_scheduler(self.scheduler)
            except ExecutorLost:
                in_flight.clear()
                await self._resync()

    async def _fill(self, in_flight: deque) -> None:
        """Schedules and sends steps until max_steps_in_flight are out or nothing is runnable.
        No new step goes out while a planned executor switch waits. Raises ExecutorLost."""
        while (len(in_flight) < self.config.max_steps_in_flight and self._switch is None
               and self.scheduler.has_unfinished()):
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return
            await self.client.send(plan)
            in_flight.append(plan)

    async def _wait_for_work(self) -> None:
        """Nothing in flight: apply a waiting executor switch, or sleep until a request arrives."""
        if self._switch is not None:
            await self._apply_switch()
            return
        self.metrics.observe_scheduler(self.scheduler)
        self._wakeup.clear()
        await self._wakeup.wait()

    async def _resync(self) -> None:
        """Frees everything mapped on the lost executor; every unfinished sequence is recomputed."""
        self.num_resyncs += 1
        self.metrics.executor_reconnects.inc()
        self._set_attached(False)
        self.scheduler.reset_executor()
        connect = asyncio.create_task(self.client.connect())
        switch = asyncio.create_task(self._switch_requested.wait())
        done, _ = await asyncio.wait({connect, switch}, return_when=asyncio.FIRST_COMPLETED)
        if connect in done:
            switch.cancel()
            await self._attach(connect.result())
        else:  # a planned switch arrived while this executor was away: the loop applies it
            connect.cancel()
            await asyncio.gather(connect, return_exceptions=True)

    def _emit(self, update: SeqUpdate) -> None:
        state = self._requests.get(update.seq.seq_id)
        if state is None:  # aborted while its step was in flight
            return
        now = time.monotonic()
        if state.last_token_time is None:
            self.metrics.ttft.observe(now - state.arrival_time)
        else:
            self.metrics.itl.observe(now - state.last_token_time)
        state.last_token_time = now
        self.metrics.generated_tokens.inc()
        text, matched = state.text_for(update.token_id)
        index = update.seq.num_output_tokens - 1
        state.queue.put_nowait(TokenEvent(update.token_id, text, index))
        if matched:
            self.scheduler.finish_seq(update.seq.seq_id, FinishReason.STOP_STRING)
            self._finish(state, FinishReason.STOP_STRING, tail="")
        elif update.finish_reason is not None:
            self._finish(state, update.finish_reason)

    def _finish(self, state: _RequestState, reason: FinishReason, tail: str | None = None) -> None:
        if tail is None:
            tail = state.flush()
        state.finished = True
        self._forget(state)
        self.metrics.requests_finished.labels(reason.name.lower()).inc()
        self.metrics.e2e.observe(time.monotonic() - state.arrival_time)
        seq = state.seq
        state.queue.put_nowait(FinishEvent(reason, seq.num_prompt_tokens, seq.num_output_tokens, tail))
