"""The scheduler service's engine: attaches an executor (and resyncs or switches it), admits
requests, and runs the step loop: schedule, run on the executor, hand the results to the output
side. Plain asyncio; no gRPC types."""
from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from scheduler_svc.admission import retry_hint_s
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.errors import ExecutorDisagreement, InvalidArgument
from scheduler_svc.executor_client import ExecutorClient, ExecutorLost
from scheduler_svc.metrics import Metrics, StatsLog
from scheduler_svc.output import EngineFailed, OutputProcessor, RequestState
from scheduler_svc.plan import SeqUpdate, StepPlan, StepResult
from scheduler_svc.request import (FinishEvent, GenerateSpec, ModelLimits, PreparedRequest,
                                   RequestLimits, TokenEvent, check_sizes, prepare)
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_stats import SchedulerStats
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue has no room for the request's sequences, or would keep it from starting
    before its deadline; mapped to RESOURCE_EXHAUSTED (HTTP 429), with a hint of when to retry."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(f"{message}; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s


class NoExecutor(Exception):
    """No executor has been reachable for longer than the grace period; mapped to UNAVAILABLE."""


class ShuttingDown(Exception):
    """The service is draining before it stops; mapped to UNAVAILABLE."""


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot for Admin.GetStatus; zeros while no executor is attached."""

    attached: bool
    executor_address: str
    model_name: str
    attach_error: str
    scheduler: SchedulerStats = SchedulerStats()
    steps: int = 0
    resyncs: int = 0
    loop_failures: int = 0
    draining: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What ModelInfo answers: the attached executor's model and pools."""

    model_name: str
    fingerprint: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    # Sequences waiting to start (a request counts its n samples); beyond it, QueueFull.
    max_waiting: int = 4096
    unavailable_grace_s: float = 30.0
    # Steps sent before the oldest one's result is back: 2 lets the scheduler plan step N+1
    # while the executor runs step N (async scheduling); 1 is lockstep.
    max_steps_in_flight: int = 2
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Threads that tokenize and template prompts off the event loop (the tokenizer releases
    # the GIL); more would only let large prompts take more cores from the step loop.
    num_prepare_threads: int = 2
    # Seconds between stats lines (logged only for an interval in which a step ran); 0: none.
    log_stats_interval_s: float = 10.0
    # A stream is handed its tokens every stream_interval steps (its first token and its end at
    # once); 0: adaptive (output.stream_interval), so that a thousand streams do not cost the
    # step loop a thousand writes a step (vLLM's --stream-interval, made adaptive).
    stream_interval: int = 0


# A prompt of token ids up to this long, without stop strings, is prepared on the event loop:
# its checks cost less there than the hand-over to a prepare thread and back. Text, chat and
# stop strings, whose cost grows much faster with the request, go to a prepare thread.
INLINE_PREPARE_MAX_IDS = 8192


def can_prepare_inline(spec: GenerateSpec) -> bool:
    """Whether preparing `spec` is cheap and bounded enough to run on the event loop."""
    ids = spec.prompt_token_ids
    return ids is not None and len(ids) <= INLINE_PREPARE_MAX_IDS and not spec.stopping.stop


# Net allocations of tracked objects between young collections once serving (default 700).
GC_YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> int:
    """Moves every object alive now (modules, the tokenizer, the engine) out of the garbage
    collector's reach, as vLLM does once it is ready: a full collection, a pause of the step
    loop's thread long enough to make a plan late, then scans only what serving allocates.
    Also raises the youngest generation's threshold: a step allocates and frees an event or
    two per stream, almost none of which survive. For a service process once it is ready; not
    for tests, which would keep every engine they make. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    return gc.get_freeze_count()


class Engine:
    """Continuous batching over one executor link, with resync when the executor is lost and a
    supervisor that restarts the step loop if it ever fails."""

    def __init__(self, config: EngineConfig, client: ExecutorClient,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics or Metrics()
        self.output = OutputProcessor(self.metrics, config.stream_interval)
        self.scheduler: Scheduler | None = None  # None while no executor is attached
        self.tokenizer = None
        self.limits: ModelLimits | None = None
        self._tokenizer_source: str | None = None
        self._seq_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()  # set while a scheduler (and so a tokenizer) exists
        self._detached_since: float | None = time.monotonic()
        self._prepare_pool = ThreadPoolExecutor(config.num_prepare_threads,
                                                thread_name_prefix="prepare")
        self._draining = False
        self._watched: ExecutorClient | None = None  # the client whose news the hooks bring
        self._stream_end: str | None = None  # why its stream ended unprompted
        self._refusal: str | None = None  # why every executor refused this scheduler
        self._refused = asyncio.Event()
        self._switch: tuple[ExecutorClient, object, asyncio.Future] | None = None
        self._switch_requested = asyncio.Event()
        self.attached = False
        self.attach_error = ""  # why no executor is attached, when one is not
        self.on_attached_change = None  # callable(bool): health reporting hooks in here
        self.num_resyncs = 0
        self.num_steps = 0
        self.num_loop_failures = 0
        self.stats = StatsLog(time.monotonic())
        self._stats_task: asyncio.Task | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the supervised step loop; it attaches an executor first (see wait_ready)."""
        self._task = asyncio.create_task(self._supervise(), name="engine-loop")
        if self.config.log_stats_interval_s > 0:
            self._stats_task = asyncio.create_task(
                self._log_stats_every(self.config.log_stats_interval_s), name="engine-stats")

    async def wait_ready(self) -> None:
        """Returns once an executor is attached and its tokenizer loaded."""
        await self._ready.wait()

    def start_draining(self) -> None:
        """Stops admission: new requests get UNAVAILABLE, running ones go on."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self.output.idle.wait()

    @property
    def num_requests(self) -> int:
        return len(self.output.requests)

    async def stop(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
        if self._task is not None:
            # Cancel until it takes: asyncio.wait_for (Python < 3.12) can swallow a cancellation
            # that lands as the awaited stream read completes, and the loop would run on.
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    async def _supervise(self) -> None:
        """Attaches, then runs the step loop; if the loop ever fails, every stream gets an error,
        health goes NOT_SERVING, and serving starts again on a fresh executor stream."""
        backoff = 0.1
        while True:
            await self._connect_and_attach()
            try:
                await self._run()
            except Exception as err:  # noqa: BLE001 - a bug must not end serving for good
                await self._on_loop_failure(err)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _on_loop_failure(self, err: Exception) -> None:
        """Ends every request with EngineFailed and forgets all scheduler state."""
        self.num_loop_failures += 1
        self.attach_error = f"the step loop failed: {err!r}; restarting"
        log.error("the step loop failed; ending %d requests and restarting it",
                  self.num_requests, exc_info=err)
        self._set_attached(False)
        self.output.fail_all(EngineFailed(f"the server's step loop failed ({type(err).__name__})"
                                          "; this request was ended, retry it"))
        self.scheduler, self._detached_since = None, time.monotonic()
        self._ready.clear()
        if self._switch is not None:
            client, _, done = self._switch
            self._switch = None
            self._switch_requested.clear()
            done.set_exception(EngineFailed("the step loop failed during the switch"))
            await client.close()
        await self.client.close()  # the next stream starts the executor from empty state

    # --- attaching an executor ------------------------------------------------------------------

    async def _connect_and_attach(self) -> None:
        """Connects to an executor and attaches it; an attach that fails (e.g. its tokenizer cannot
        be loaded) is logged at once, shown in status, and retried with backoff."""
        backoff = 0.1
        while True:
            if not self.attach_error:
                self.attach_error = ("waiting for an executor at "
                                     f"{', '.join(self.client.addresses)}")
            self._watch(self.client)
            self._stream_end = None  # a new stream is being opened
            description = await self.client.connect()
            try:
                await self._attach(description)
                return
            except Exception as err:  # noqa: BLE001 - reported, then retried
                self.attach_error = f"attaching {self.client.connected_address} failed: {err}"
                log.error("%s; retrying in %.1fs", self.attach_error, backoff)
                await self.client.close()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _attach(self, description) -> None:
        """Sizes the block pools from Describe's answer (never from a guess), loads the tokenizer."""
        if description.tokenizer != self._tokenizer_source:
            try:
                self.tokenizer = await asyncio.to_thread(load_tokenizer, description.tokenizer)
            except Exception as err:  # noqa: BLE001 - any reason a tokenizer will not load
                raise RuntimeError(f"the tokenizer at {description.tokenizer!r} did not load: "
                                   f"{type(err).__name__}: {err}") from err
            self._tokenizer_source = description.tokenizer
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.limits = ModelLimits(description.vocab_size, description.max_model_len, eos)
        pools = description.block_size, description.num_gpu_blocks, description.num_cpu_blocks
        if self.scheduler is None:
            block_manager = BlockManager(
                *pools, enable_prefix_caching=self.config.scheduler.enable_prefix_caching,
                cache_salt=description.fingerprint)
            self.scheduler = Scheduler(self.config.scheduler, block_manager)
            self.metrics.on_new_scheduler()
        else:
            self.scheduler.reset_for_executor(*pools, cache_salt=description.fingerprint)
        self.attach_error = ""
        self._detached_since = None
        self._refusal = None
        self._refused.clear()
        self._watch(self.client)  # a planned switch attaches a client of its own
        self._ready.set()
        self._set_attached(True)

    def _watch(self, client: ExecutorClient) -> None:
        """Hooks this engine to what `client` learns unprompted (a stream end reported by
        another client is forgotten)."""
        if client is not self._watched:
            self._stream_end, self._watched = None, client
        client.on_stream_end = functools.partial(self._on_stream_end, client)
        client.on_refused = self._on_refused

    def _on_stream_end(self, client: ExecutorClient, reason: str) -> None:
        if client is self.client:  # not a client a planned switch has just replaced
            self._stream_end = reason
            self._wakeup.set()  # an idle step loop finds out now, not at the next request

    def _on_refused(self, reason: str) -> None:
        """Every executor refused this scheduler (another one holds the lease): requests fail
        now rather than wait for a lease that may never come back."""
        self._refusal = self.attach_error = reason
        self._refused.set()

    def _set_attached(self, attached: bool) -> None:
        self.attached = attached
        if self.on_attached_change is not None:
            self.on_attached_change(attached)

    async def _resync(self) -> None:
        """Frees everything mapped on the lost executor; every unfinished sequence is recomputed."""
        self.num_resyncs += 1
        self.metrics.executor_reconnects.inc()
        self._set_attached(False)
        self.scheduler.reset_executor()
        connect = asyncio.create_task(self._connect_and_attach())
        switch = asyncio.create_task(self._switch_requested.wait())
        outage = asyncio.create_task(self._end_requests_in_outage())
        try:
            done, _ = await asyncio.wait({connect, switch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            outage.cancel()
        if connect in done:
            switch.cancel()
            connect.result()
        else:  # a planned switch arrived while this executor was away: the loop applies it
            connect.cancel()
            await asyncio.gather(connect, return_exceptions=True)

    async def _end_requests_in_outage(self) -> None:
        """While the step loop reconnects: once every executor refuses this scheduler (its lease
        was taken over) or the outage outlasts the grace period, the open requests end with
        UNAVAILABLE instead of waiting for their deadlines; _check_open refuses later ones."""
        lost_since = self.client.disconnected_since or time.monotonic()
        left = self.config.unavailable_grace_s - (time.monotonic() - lost_since)
        try:
            await asyncio.wait_for(self._refused.wait(), max(left, 0))
            error = NoExecutor(f"no executor takes this scheduler: {self._refusal}")
        except asyncio.TimeoutError:
            error = NoExecutor(f"no executor reachable for {self.config.unavailable_grace_s:g}s"
                               f"{self._why()}")
        if self.num_requests:
            log.warning("ending %d requests: %s", self.num_requests, error)
        self._finish_seqs(self.output.fail_all(error))

    async def switch_executor(self, addresses: list[str]) -> tuple[str, str, int]:
        """Moves serving to the first of `addresses` that serves the same model; the unfinished
        sequences are recomputed there. Returns (address, model name, sequences moved)."""
        old = self.client
        if old.fingerprint is None:
            raise NoExecutor("no executor has attached yet: nothing to move")
        client = old.with_addresses(addresses)
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
        await self._attach(description)  # resets the scheduler for the new executor
        await old.close()
        log.info("serving moved to executor %s; %d sequences recomputed there",
                 client.connected_address, moved)
        done.set_result((client.connected_address, description.model_name, moved))

    # --- what the API reports --------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        """The attached model; raises NoExecutor if none has attached yet."""
        d = self.client.description
        if self.limits is None or d is None:
            raise NoExecutor(f"no executor attached yet{self._why()}")
        return ModelInfo(d.model_name, d.fingerprint, d.max_model_len, d.vocab_size,
                         self.limits.eos_token_id, d.dtype, d.block_size, d.num_gpu_blocks,
                         d.num_cpu_blocks)

    def status(self) -> EngineStatus:
        d = self.client.description
        base = dict(attached=self.attached, executor_address=self.client.connected_address or "",
                    model_name=d.model_name if d is not None else "",
                    attach_error=self.attach_error, steps=self.num_steps,
                    resyncs=self.num_resyncs, loop_failures=self.num_loop_failures,
                    draining=self._draining)
        if self.scheduler is None:
            return EngineStatus(**base)
        return EngineStatus(**base, scheduler=self.scheduler.stats())

    async def _log_stats_every(self, interval_s: float) -> None:
        """The periodic stats line, for every interval in which a step ran. A failure to make it
        is logged and the next interval tried: the stats line must never end serving."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                line = self.stats.line(time.monotonic(), self.status().scheduler)
            except Exception:  # noqa: BLE001 - logged loudly, never fatal
                log.exception("the stats line failed")
                continue
            if line is not None:
                log.info("%s", line)

    def _why(self) -> str:
        return f": {self.attach_error}" if self.attach_error else ""

    # --- requests -------------------------------------------------------------------------------

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Token events, then one FinishEvent, per sample (spec.n of them, interleaved, each
        event naming its sample_index). Leaving early (cancel, disconnect) aborts every sample.
        Raises InvalidArgument, QueueFull, NoExecutor, ShuttingDown or EngineFailed."""
        async for events in self.generate_batches(spec):
            for event in events:
                yield event

    async def generate_batches(self, spec: GenerateSpec
                               ) -> AsyncIterator[list[TokenEvent | FinishEvent]]:
        """As `generate`, but each item is every event queued by then (at least one), in order:
        a consumer slower than the steps takes what piled up at once and can answer it with one
        write. Raises as `generate` does."""
        states = await self.admit(spec)
        try:
            async for events in states[0].mailbox.batches(len(states)):  # the samples share it
                yield events
        finally:
            for state in states:
                if not state.finished:
                    self._finish_seqs(self.output.abort(state))

    async def admit(self, spec: GenerateSpec) -> list[RequestState]:
        """Checks, prepares and queues one request, a seq per sample; raises InvalidArgument,
        QueueFull, NoExecutor or ShuttingDown. Waits, up to what is left of the grace period,
        for a first (or restarted) executor attachment."""
        check_sizes(spec, self.config.limits)
        self._check_open()
        if self.scheduler is None:
            await self._wait_attached()
        self._check_admissible(spec)
        if can_prepare_inline(spec):
            prepared = prepare(spec, self.tokenizer, self.limits)
        else:
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, prepare, spec, self.tokenizer, self.limits)
        self._check_admissible(spec)  # the state may have changed while it was prepared
        seqs = self._sample_seqs(spec, prepared)
        self._check_fits(seqs[0])
        # Assigns a seed to each seq without one (recomputes sample alike); the samples after
        # the first fork from its pages once its prompt is computed.
        self.scheduler.add_seq(seqs[0], seqs[1:])
        states = self.output.add_request(spec.request_id, seqs, prepared.stoppers,
                                         self.tokenizer)
        self.metrics.prompt_tokens.inc(seqs[0].num_prompt_tokens)
        log.debug("request %s admitted as seqs %s: %d prompt tokens", spec.request_id,
                  [seq.seq_id for seq in seqs], seqs[0].num_prompt_tokens)
        self._wakeup.set()
        return states

    async def _wait_attached(self) -> None:
        """Until an executor attaches, every executor refuses this scheduler, or the grace ends."""
        left = self.config.unavailable_grace_s - (time.monotonic() - self._detached_since)
        if left <= 0:
            return
        ready = asyncio.ensure_future(self._ready.wait())
        refused = asyncio.ensure_future(self._refused.wait())
        try:
            await asyncio.wait({ready, refused}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            refused.cancel()

    def _check_admissible(self, spec: GenerateSpec) -> None:
        """Refuses a request while closed (see _check_open) or detached, or (QueueFull) one whose
        n sequences would take the waiting sequences past --max-waiting (unless none wait), or
        whose deadline ends before the sequences ahead of it can start at the rate waiting
        sequences have been starting."""
        self._check_open()
        if self.scheduler is None:
            raise NoExecutor(f"the executor was detached{self._why()}")
        waiting, rate = self.scheduler.num_waiting, self.scheduler.drain_rate()
        over = waiting + spec.n - self.config.max_waiting
        if over > 0 and waiting:
            raise QueueFull(f"{waiting} sequences are waiting and this request adds {spec.n}: "
                            f"over --max-waiting ({self.config.max_waiting})",
                            retry_hint_s(over / rate if rate else None))
        if spec.deadline is None or not waiting or rate is None:
            return
        left, wait = spec.deadline - time.monotonic(), waiting / rate
        if wait > left:
            raise QueueFull(f"{waiting} sequences wait ahead of this request, starting at about "
                            f"{rate:.3g}/s: it would not start within its deadline "
                            f"({max(left, 0):.1f}s left)", retry_hint_s(wait - max(left, 0)))

    def _check_open(self) -> None:
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        if self._refusal is not None:
            raise NoExecutor(f"no executor takes this scheduler: {self._refusal}")
        if self.scheduler is None:
            if time.monotonic() - self._detached_since < self.config.unavailable_grace_s:
                return
            raise NoExecutor(f"no executor attached for "
                             f"{time.monotonic() - self._detached_since:.0f}s{self._why()}")
        lost_since = self.client.disconnected_since
        grace = self.config.unavailable_grace_s
        if lost_since is not None and time.monotonic() - lost_since > grace:
            raise NoExecutor(f"no executor reachable for {time.monotonic() - lost_since:.0f}s"
                             f"{self._why()}")

    def _sample_seqs(self, spec: GenerateSpec, prepared: PreparedRequest) -> list[Sequence]:
        """A seq per sample; with a seed, sample i uses seed + i (as the OpenAI API's n did with
        n requests, and vLLM with its parallel samples): distinct and reproducible."""
        seqs: list[Sequence] = []
        for _ in range(spec.n):  # one arrival time: the samples are one request, in age order
            seqs.append(Sequence(next(self._seq_ids), prepared.prompt_token_ids, spec.sampling,
                                 spec.stopping, self.limits.eos_token_id,
                                 self.limits.max_model_len,
                                 seqs[0].arrival_time if seqs else None))
        if spec.sampling.seed is not None:
            for i, seq in enumerate(seqs):
                seq.seed = (spec.sampling.seed + i) % 2**64
        return seqs

    def _check_fits(self, seq: Sequence) -> None:
        """The one check that a request fits the KV cache: an explicit max_tokens must fit in
        the whole cache; without one, the cache's size caps the output (finish reason LENGTH)."""
        if seq.stopping.max_tokens is None:
            needed, what = seq.num_prompt_tokens + 1, "prompt"
        else:
            needed, what = seq.num_prompt_tokens + seq.max_tokens, "max_tokens"
        if not self.scheduler.can_ever_fit(needed):
            raise InvalidArgument(
                what, f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens "
                f"({seq.max_tokens}) can never fit in the KV cache")

    def abort_all(self, reason: FinishReason = FinishReason.ABORTED) -> None:
        """Ends every request now (shutdown): each stream gets its FinishEvent."""
        self._finish_seqs(self.output.finish_all(reason))

    def _finish_seqs(self, seqs: list[tuple[int, FinishReason]]) -> None:
        """Frees in the scheduler the seqs the output side ended."""
        if self.scheduler is not None:
            for seq_id, reason in seqs:
                self.scheduler.finish_seq(seq_id, reason)
            self.metrics.observe_scheduler(self.scheduler.stats())
        self._wakeup.set()

    # --- the step loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        """Keeps up to max_steps_in_flight plans sent, and steps while any are; a lost executor
        is resynced, the requests it names as the cause ended."""
        in_flight: deque[StepPlan] = deque()
        while True:
            try:
                await self._fill(in_flight)
                if in_flight:
                    await self._step(in_flight)
                else:
                    await self._wait_for_work()
            except ExecutorLost as lost:
                in_flight.clear()
                self._end_named(lost)  # before the resync, which would recompute them
                await self._resync()

    async def _step(self, in_flight: deque[StepPlan]) -> None:
        """The oldest plan's result is applied, the next plan goes out, and only then are that
        result's tokens streamed, so the executor always has a step queued while the host works."""
        result = await self.client.receive(in_flight[0])
        plan = in_flight.popleft()
        updates = await self._apply(plan, result.sampled)
        self._account(plan, result, len(updates))
        try:
            await self._fill(in_flight)
        finally:
            self._finish_seqs(self.output.process_outputs(updates, result.logprobs))
            self.metrics.steps.inc()

    async def _fill(self, in_flight: deque[StepPlan]) -> None:
        """Schedules and sends steps until max_steps_in_flight are out or nothing is runnable.
        No new step goes out while a planned executor switch waits. Raises ExecutorLost."""
        while (len(in_flight) < self.config.max_steps_in_flight and self._switch is None
               and self.scheduler.has_unfinished()):
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return
            await self.client.send(plan)
            in_flight.append(plan)

    async def _apply(self, plan: StepPlan, sampled: dict[int, int]) -> list[SeqUpdate]:
        """The step's updates; an executor whose answer does not fit the plan is lost."""
        try:
            return self.scheduler.update_from_output(plan, sampled)
        except ExecutorDisagreement as err:
            lost = self.client.lost(f"its result disagrees with the plan: {err}")
            await self.client.close()
            raise lost from err

    def _account(self, plan: StepPlan, result: StepResult, num_sampled: int) -> None:
        """Counts a step for the stats line, and the executor's times for it in the metrics."""
        num_tokens = plan.num_scheduled_tokens
        self.num_steps += 1
        self.stats.on_step(num_tokens, num_sampled)
        if num_tokens:  # a plan of copies and drops only runs no forward pass
            kind = "decode" if num_tokens == plan.num_scheduled_seqs else "prefill"
            self.metrics.observe_executor_step(kind, result.forward_ms, result.step_ms)

    async def _wait_for_work(self) -> None:
        """Nothing in flight: apply a waiting executor switch, or sleep until a request arrives.
        A stream that ends meanwhile raises ExecutorLost at once: health, the prefix cache and
        the next request must not wait for a step to learn that the executor is gone."""
        if self._switch is not None:
            await self._apply_switch()
            return
        self.metrics.observe_scheduler(self.scheduler.stats())
        self._wakeup.clear()
        if self._stream_end is None:
            await self._wakeup.wait()
        if self._stream_end is not None:
            raise self.client.lost(self._stream_end)

    def _end_named(self, lost: ExecutorLost) -> None:
        """Ends the requests of the seqs a lost link names as the cause (their own values failed
        the plan): recomputed, they would fail it again."""
        for seq_id in lost.seq_ids:
            state = self.output.requests.get(seq_id)
            if state is not None:
                log.error("request %s (seq %d) ended: it failed the step (%s); the others are "
                          "recomputed", state.request_id, seq_id, lost)
                self._finish_seqs(self.output.fail_request(
                    state, f"the executor link failed on it: {str(lost)[:300]}"))
