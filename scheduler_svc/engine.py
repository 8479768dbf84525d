"""The engine: attaches an executor (resyncs or switches it) and runs the step loop: schedule, run
on the executor, hand the results to the output side. Plain asyncio; no gRPC types."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from scheduler_svc.admission import Admission, NoExecutor, check_fits
from scheduler_svc.engine_types import EngineConfig, EngineStatus, ModelInfo
from scheduler_svc.errors import ExecutorDisagreement, InvalidArgument
from scheduler_svc.executor_client import ExecutorClient, ExecutorLost
from scheduler_svc.metrics import Metrics, StatsLog
from scheduler_svc.output import EngineFailed, OutputProcessor, RequestState
from scheduler_svc.plan import SeqUpdate, StepPlan, StepResult
from scheduler_svc.request import FinishEvent, GenerateSpec, TokenEvent, check_sizes
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_stats import SchedulerStats
from scheduler_svc.sequence import FinishReason
from scheduler_svc.step_limits import StepLimitPolicy

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over one executor link, which it attaches, resyncs and switches."""

    def __init__(self, config: EngineConfig, client: ExecutorClient,
                 metrics: Metrics | None = None) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics or Metrics()
        self.output = OutputProcessor(self.metrics, config.stream_interval)
        self.scheduler: Scheduler | None = None  # None while no executor is attached
        self.admission = Admission(config)
        self.step_limits = StepLimitPolicy(config.scheduler, config.step_limits_given)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._watched: ExecutorClient | None = None  # the client whose news the hooks bring
        self._stream_end: str | None = None  # why its stream ended unprompted
        self._switch: tuple[ExecutorClient, object, asyncio.Future] | None = None
        self._switch_requested = asyncio.Event()
        self.attached = False
        self.attach_error = ""  # why no executor is attached, when one is not
        self.on_attached_change = None  # callable(bool): health reporting hooks in here
        self.num_resyncs = self.num_steps = self.num_loop_failures = 0
        self.stats = StatsLog(time.monotonic())
        self._stats_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Starts the supervised step loop; it attaches an executor first (see wait_ready)."""
        self._task = asyncio.create_task(self._supervise(), name="engine-loop")
        if self.config.log_stats_interval_s > 0:
            self._stats_task = asyncio.create_task(
                self._log_stats_every(self.config.log_stats_interval_s), name="engine-stats")

    async def wait_ready(self) -> None:
        """Returns once an executor is attached and its tokenizer loaded."""
        await self.admission.ready.wait()

    def start_draining(self) -> None:
        """Stops admission: new requests get UNAVAILABLE, running ones go on."""
        self.admission.draining = True

    @property
    def draining(self) -> bool:
        return self.admission.draining

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self.output.idle.wait()

    @property
    def tokenizer(self):
        """The attached model's tokenizer; None before the first attach, or if it has none."""
        return self.admission.tokenizer

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
        self.admission.close()

    async def _supervise(self) -> None:
        """Attaches, then runs the step loop; a failed loop ends every request and starts again."""
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
        self.scheduler = None
        self.admission.on_detached()
        if self._switch is not None:
            client, _, done = self._take_switch()
            done.set_exception(EngineFailed("the step loop failed during the switch"))
            await client.close()
        await self.client.close()  # the next stream starts the executor from empty state

    async def _connect_and_attach(self) -> None:
        """Connects and attaches; a failed attach is logged, shown in status and retried."""
        backoff = 0.1
        while True:
            if not self.attach_error:
                self.attach_error = f"waiting for an executor at {', '.join(self.client.addresses)}"
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
        """Pools and step limits from Describe's answer (and the flags); loads the tokenizer."""
        await self.admission.load_model(description)
        config = self.step_limits.for_executor(description.step_limits,
                                               self.client.connected_address or "")
        pools = description.block_size, description.num_gpu_blocks, description.num_cpu_blocks
        salt = description.fingerprint
        if self.scheduler is None:
            self.scheduler = Scheduler.for_executor(config, *pools, cache_salt=salt)
            self.metrics.on_new_scheduler()
        else:
            self.scheduler.reset_for_executor(*pools, cache_salt=salt, config=config)
        self.attach_error = ""
        self._watch(self.client)  # a planned switch attaches a client of its own
        self.admission.on_attached()
        self._set_attached(True)

    def _watch(self, client: ExecutorClient) -> None:
        """Hooks this engine to what `client` learns unprompted (its stream's end, refusals)."""
        if client is not self._watched:
            self._stream_end, self._watched = None, client
        client.on_stream_end = functools.partial(self._on_stream_end, client)
        client.on_refused = self._on_refused

    def _on_stream_end(self, client: ExecutorClient, reason: str) -> None:
        if client is self.client:  # not a client a planned switch has just replaced
            self._stream_end = reason
            self._wakeup.set()  # an idle step loop finds out now, not at the next request

    def _on_refused(self, reason: str) -> None:
        """Every executor refused this scheduler (another one holds the lease)."""
        self.attach_error = reason
        self.admission.on_refused(reason)

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
        """While reconnecting: ends the open requests once admission would refuse new ones."""
        error = await self.admission.outage_error(
            self.client.disconnected_since or time.monotonic(), self._why)
        if self.num_requests:
            log.warning("ending %d requests: %s", self.num_requests, error)
        self._finish_seqs(self.output.fail_all(error))

    async def switch_executor(self, addresses: list[str]) -> tuple[str, str, int]:
        """Moves serving (its seqs recomputed) to the first of `addresses` serving the same model;
        returns (address, model name, sequences moved)."""
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

    def _take_switch(self) -> tuple[ExecutorClient, object, asyncio.Future]:
        switch, self._switch = self._switch, None
        self._switch_requested.clear()
        return switch

    async def _apply_switch(self) -> None:
        """Between steps: the new client replaces the old, all executor-side state is rebuilt."""
        client, description, done = self._take_switch()
        old, self.client = self.client, client
        moved = self.scheduler.num_running + self.scheduler.num_swapped
        await self._attach(description)  # resets the scheduler for the new executor
        await old.close()
        log.info("serving moved to executor %s; %d sequences recomputed there",
                 client.connected_address, moved)
        done.set_result((client.connected_address, description.model_name, moved))

    def model_info(self) -> ModelInfo:
        """The attached model; raises NoExecutor if none has attached yet."""
        d, limits = self.client.description, self.admission.limits
        if limits is None or d is None:
            raise NoExecutor(f"no executor attached yet{self._why()}")
        return ModelInfo.of(d, limits.eos_token_id)

    def status(self) -> EngineStatus:
        d = self.client.description
        return EngineStatus(
            self.attached, self.client.connected_address or "",
            d.model_name if d is not None else "", self.attach_error,
            self.scheduler.stats() if self.scheduler is not None else SchedulerStats(),
            self.num_steps, self.num_resyncs, self.num_loop_failures, self.admission.draining)

    async def _log_stats_every(self, interval_s: float) -> None:
        """The periodic stats line; a failure to make it is logged, never fatal."""
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

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Token events, then a FinishEvent, per sample; raises as `admit` does, or EngineFailed."""
        async for events in self.generate_batches(spec):
            for event in events:
                yield event

    async def generate_batches(self, spec: GenerateSpec
                               ) -> AsyncIterator[list[TokenEvent | FinishEvent]]:
        """As `generate`, in batches of what is queued by then; leaving early aborts its samples."""
        states = await self.admit(spec)
        try:
            async for events in states[0].mailbox.batches(len(states)):  # the samples share it
                yield events
        finally:
            for state in states:
                if not state.finished:
                    self._finish_seqs(self.output.abort(state))

    async def admit(self, spec: GenerateSpec) -> list[RequestState]:
        """Checks, prepares and queues one request, a seq per sample, waiting within the grace for
        an executor; raises InvalidArgument, QueueFull, NoExecutor or ShuttingDown."""
        check_sizes(spec, self.config.limits)
        self.admission.check_open(self.client.disconnected_since, self._why)
        if self.scheduler is None:
            await self.admission.wait_attached()
        self.admission.check(spec, self.scheduler, self.client.disconnected_since, self._why)
        prepared = await self.admission.prepare(spec)
        # The state may have changed while it was prepared.
        self.admission.check(spec, self.scheduler, self.client.disconnected_since, self._why)
        seqs = self.admission.new_seqs(spec, prepared)
        check_fits(seqs[0], self.scheduler.can_ever_fit)
        self.scheduler.add_seq(seqs[0], seqs[1:])
        states = self.output.add_request(spec.request_id, seqs, prepared.stoppers, self.tokenizer)
        self.metrics.prompt_tokens.inc(seqs[0].num_prompt_tokens)
        log.debug("request %s admitted as seqs %s: %d prompt tokens", spec.request_id,
                  [seq.seq_id for seq in seqs], seqs[0].num_prompt_tokens)
        self._wakeup.set()
        return states

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

    async def _run(self) -> None:
        """Keeps up to max_steps_in_flight plans sent; resyncs a lost executor."""
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
        """Schedules and sends plans up to max_steps_in_flight; none while a switch waits."""
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
        """Applies a waiting switch, or sleeps until there is work or the stream ends."""
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
        """Ends the requests a lost link names as the cause: recomputed, they would fail again."""
        self._finish_seqs(self.output.fail_seqs(lost.seq_ids, lost))
