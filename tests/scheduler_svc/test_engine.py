"""The engine in-process over a fake executor link: an executor that disagrees with the plan is
lost and recomputed on, a failing step loop ends its streams loudly and serving resumes, and
requests sent before an executor attaches wait for it within the grace period."""
import asyncio
import contextlib
import dataclasses
import time
from collections import deque

import pytest

from sched_factories import FakeExecutor
from scheduler_svc.admission import NoExecutor, QueueFull
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.executor_client import ExecutorLost
from scheduler_svc.output import EngineFailed
from scheduler_svc.plan import StepResult
from scheduler_svc.request import FinishEvent, GenerateSpec, RequestLimits
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.wire import ExecutorDescription

BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 4, 64, 32
DESCRIPTION = ExecutorDescription(
    model_name="fake", fingerprint="f" * 64, dtype="float32", block_size=BLOCK_SIZE,
    num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=NUM_CPU_BLOCKS, max_model_len=256,
    vocab_size=1000, tokenizer="", backend="cpu", instance_id=1)


class FakeClient:
    """ExecutorClient's interface over a FakeExecutor; `tamper(n, plan, sampled)` may rewrite the
    n-th result, `attachable` gates connect()."""

    def __init__(self, tamper=None) -> None:
        self.executor = FakeExecutor(BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS)
        self.tamper = tamper or (lambda n, plan, sampled: sampled)
        self.attachable = asyncio.Event()
        self.attachable.set()
        self.results_flow = asyncio.Event()  # cleared: receive() waits
        self.results_flow.set()
        self.description = None
        self.addresses = ["fake:1"]
        self.connected_address = None
        self.fingerprint = None
        self.disconnected_since = time.monotonic()
        self.num_connects = 0
        self.num_results = 0
        self._results: deque = deque()

    async def connect(self):
        await self.attachable.wait()
        self.executor.reset()  # a new stream starts from empty executor state
        self._results.clear()
        self.num_connects += 1
        self.description, self.connected_address = DESCRIPTION, "fake:1"
        self.fingerprint, self.disconnected_since = DESCRIPTION.fingerprint, None
        return DESCRIPTION

    async def send(self, plan) -> None:
        self._results.append(self.executor.execute(plan))

    async def receive(self, plan) -> StepResult:
        await asyncio.sleep(0)
        await self.results_flow.wait()
        if not self._results:
            raise ExecutorLost("closed")
        self.num_results += 1
        sampled = self.tamper(self.num_results, plan, self._results.popleft())
        return StepResult(sampled, forward_ms=2.0, step_ms=3.0)

    def lost(self, reason: str) -> ExecutorLost:
        self.disconnected_since = time.monotonic()
        return ExecutorLost(reason)

    async def close(self) -> None:
        self._results.clear()


def spec(i: int, max_tokens: int = 12) -> GenerateSpec:
    return GenerateSpec(prompt_token_ids=[10 + (i * 7 + j) % 900 for j in range(5 + i % 7)],
                        stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True))


async def collect(engine: Engine, s: GenerateSpec) -> list[int] | Exception:
    try:
        return [e.token_id async for e in engine.generate(s) if not isinstance(e, FinishEvent)]
    except Exception as err:  # noqa: BLE001 - the tests look at which
        return err


async def serve(client: FakeClient, specs, config: EngineConfig = EngineConfig(), during=None):
    """Runs `specs` concurrently on a started engine; `during(engine)` runs alongside."""
    engine = Engine(config, client)
    health: list[bool] = []
    engine.on_attached_change = health.append
    await engine.start()
    try:
        tasks = [asyncio.create_task(collect(engine, s)) for s in specs]
        if during is not None:
            await during(engine)
        return await asyncio.gather(*tasks), engine, health
    finally:
        await engine.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


SPECS = [spec(i) for i in range(12)]


@pytest.fixture(scope="module")
def undisturbed():
    outputs, _, _ = run(serve(FakeClient(), SPECS))
    assert all(isinstance(o, list) and len(o) == 12 for o in outputs)
    return outputs


@pytest.mark.parametrize("how", ["missing", "extra"])
def test_an_executor_that_disagrees_is_resynced_by_recompute(undisturbed, how):
    def tamper(n, plan, sampled):
        if n != 5:
            return sampled
        if how == "missing":
            return dict(list(sampled.items())[1:])
        return {**sampled, 10**6: 7}

    client = FakeClient(tamper)
    outputs, engine, _ = run(serve(client, SPECS))
    assert outputs == undisturbed
    assert engine.num_resyncs == 1 and client.num_connects == 2
    assert engine.num_loop_failures == 0


def test_a_failing_step_loop_ends_its_streams_and_serving_resumes(undisturbed):
    client = FakeClient()
    client.results_flow.clear()  # no request can finish before all are admitted

    async def during(engine):
        while engine.num_requests < len(SPECS):
            await asyncio.sleep(0.01)
        schedule = engine.scheduler.schedule

        def broken():
            engine.scheduler.schedule = schedule
            raise RuntimeError("a bug")
        engine.scheduler.schedule = broken
        client.results_flow.set()
        while engine.num_loop_failures == 0:
            await asyncio.sleep(0.01)
        await engine.wait_ready()
        after = await asyncio.gather(*(collect(engine, s) for s in SPECS))
        # served again, from a fresh executor stream (new seq ids: other fake tokens)
        assert [len(o) for o in after] == [len(o) for o in undisturbed]

    outputs, engine, health = run(serve(client, SPECS, during=during))
    assert all(isinstance(o, EngineFailed) for o in outputs)
    assert "step loop failed" in str(outputs[0])
    assert health == [True, False, True]
    status = engine.status()
    assert status.loop_failures == 1 and status.attached and status.attach_error == ""
    assert status.scheduler.gpu_blocks_used == 0


def test_requests_wait_for_the_first_executor_within_the_grace(undisturbed):
    client = FakeClient()
    client.attachable.clear()

    async def during(engine):
        await asyncio.sleep(0.3)
        assert engine.num_requests == 0 and not engine.attached
        with pytest.raises(NoExecutor):
            engine.model_info()
        client.attachable.set()

    outputs, _, _ = run(serve(client, SPECS, EngineConfig(unavailable_grace_s=30), during))
    assert outputs == undisturbed


def test_without_an_executor_requests_fail_after_the_grace():
    client = FakeClient()
    client.attachable.clear()
    t0 = time.monotonic()
    outputs, engine, _ = run(serve(client, SPECS[:2], EngineConfig(unavailable_grace_s=0.5)))
    assert all(isinstance(o, NoExecutor) for o in outputs)
    assert 0.4 < time.monotonic() - t0 < 5
    status = engine.status()
    assert not status.attached and status.scheduler.running == 0
    assert status.scheduler.gpu_blocks_total == 0


def test_size_limits_are_checked_before_anything_else():
    limits = RequestLimits(max_prompt_bytes=100, max_chat_messages=3)
    config = EngineConfig(limits=limits)
    too_long = GenerateSpec(prompt_text="é" * 51)  # 102 bytes, 51 characters
    too_many = GenerateSpec(chat=[{"role": "user", "content": "x"}] * 4)
    big = GenerateSpec(chat=[{"role": "user", "content": "x" * 60}] * 2)
    outputs, _, _ = run(serve(FakeClient(), [too_long, too_many, big], config))
    assert [type(o) for o in outputs] == [InvalidArgument] * 3
    assert [o.field for o in outputs] == ["prompt.text", "prompt.chat.messages", "prompt.chat"]


def test_a_request_that_can_never_fit_the_kv_cache_is_refused_and_nothing_is_queued():
    """Admission's one fit check: prompt + max_tokens, or prompt + 1 without max_tokens, against
    the whole GPU pool (64 blocks of 4: 256 tokens) of a model longer than the pool."""
    class LongModelClient(FakeClient):
        async def connect(self):
            await super().connect()
            self.description = dataclasses.replace(DESCRIPTION, max_model_len=1000)
            return self.description

    def ids(n):
        return list(range(10, 10 + n))

    async def body(engine):
        refused = [await collect(engine, GenerateSpec(prompt_token_ids=ids(10),
                                                      stopping=StoppingParams(max_tokens=247))),
                   await collect(engine, GenerateSpec(prompt_token_ids=ids(256)))]
        fits = await collect(engine, GenerateSpec(prompt_token_ids=ids(10),
                                                  stopping=StoppingParams(max_tokens=246)))
        return refused, fits, engine.scheduler.stats()

    async def main():
        engine = Engine(EngineConfig(), LongModelClient())
        await engine.start()
        try:
            await engine.wait_ready()
            return await body(engine)
        finally:
            await engine.stop()

    refused, fits, stats = run(main())
    assert [type(e) for e in refused] == [InvalidArgument] * 2
    assert [e.field for e in refused] == ["max_tokens", "prompt"]
    assert isinstance(fits, list) and stats.waiting == 0 and stats.gpu_blocks_used == 0


def test_prefix_caching_is_on_unless_the_flag_or_its_variable_turns_it_off(monkeypatch):
    from scheduler_svc.main import parse_config
    assert parse_config([]).engine.scheduler.enable_prefix_caching
    assert not parse_config(["--no-prefix-caching"]).engine.scheduler.enable_prefix_caching
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_NO_PREFIX_CACHING", "1")
    assert not parse_config([]).engine.scheduler.enable_prefix_caching


def test_the_engine_salts_the_prefix_cache_with_the_executor_fingerprint():
    _, engine, _ = run(serve(FakeClient(), SPECS[:1]))
    bm = engine.scheduler.block_manager
    assert bm.enable_prefix_caching and bm.cache_salt == DESCRIPTION.fingerprint


# ---- parallel sampling --------------------------------------------------------------------

def sampled_spec(n: int, seed: int | None = None, max_tokens: int = 6) -> GenerateSpec:
    return GenerateSpec(prompt_token_ids=list(range(10, 20)), n=n,
                        sampling=SamplingParams(temperature=1.0, seed=seed),
                        stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True))


async def events_of(engine: Engine, s: GenerateSpec) -> list:
    return [e async for e in engine.generate(s)]


def test_n_samples_stream_with_their_index_and_end_after_each_finishes():
    async def main():
        engine = Engine(EngineConfig(), FakeClient())
        await engine.start()
        try:
            events = await events_of(engine, sampled_spec(4, seed=7))
            return events, engine.scheduler.stats(), engine.metrics.registry.get_sample_value
        finally:
            await engine.stop()
    events, stats, metric = run(main())
    finishes = [e for e in events if isinstance(e, FinishEvent)]
    assert isinstance(events[-1], FinishEvent)
    assert sorted(e.sample_index for e in finishes) == [0, 1, 2, 3]
    for i in range(4):
        tokens = [e for e in events if not isinstance(e, FinishEvent) and e.sample_index == i]
        assert [e.index for e in tokens] == list(range(6))
    assert stats.gpu_blocks_used == 0 and stats.num_blocks_copied == 3  # 10 tokens, pages of 4
    assert metric("pagedserve_blocks_copied_total") == 3


def test_samples_are_seeded_seed_plus_i_and_n_is_checked():
    async def main():
        engine = Engine(EngineConfig(), FakeClient())
        await engine.start()
        try:
            await engine.wait_ready()
            seeds = []
            add_seq = engine.scheduler.add_seq
            engine.scheduler.add_seq = lambda seq, samples=(): (
                seeds.extend(s.seed for s in (seq, *samples)), add_seq(seq, samples))
            await events_of(engine, sampled_spec(3, seed=2**64 - 2))
            errors = [await collect(engine, sampled_spec(n)) for n in (0, 17)]
            return seeds, errors
        finally:
            await engine.stop()
    seeds, errors = run(main())
    assert seeds == [2**64 - 2, 2**64 - 1, 0]
    assert all(isinstance(e, InvalidArgument) and e.field == "n" for e in errors)


def test_leaving_a_parallel_stream_early_frees_every_sample():
    async def main():
        engine = Engine(EngineConfig(), FakeClient())
        await engine.start()
        try:
            stream = engine.generate(sampled_spec(4, max_tokens=200))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 10:  # some samples forked and decoding
                    break
            await stream.aclose()
            while engine.scheduler.has_unfinished() or engine.num_requests:
                await asyncio.sleep(0.01)
            return engine.scheduler.stats()
        finally:
            await engine.stop()
    stats = run(main())
    assert stats.gpu_blocks_used == 0 and stats.running == 0


async def _on_engine(config: EngineConfig, body):
    """body(engine) on a started engine over a FakeClient, stopped afterwards."""
    engine = Engine(config, FakeClient())
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.stop()


def test_a_lagging_reader_gets_what_piled_up_in_one_batch(undisturbed):
    """generate_batches hands over every queued event at once: a reader that looks only after
    the request ended gets its 12 tokens and the finish in one batch, the same tokens as a
    reader that keeps up."""
    async def lagging(engine):
        batches = engine.generate_batches(SPECS[0])
        got = [await batches.__anext__()]  # admitted, its first token out
        while engine.num_requests:  # the other steps run while nobody reads
            await asyncio.sleep(0.01)
        return got + [b async for b in batches]

    batches = run(_on_engine(EngineConfig(), lagging))
    events = [e for b in batches for e in b]
    assert [e.token_id for e in events[:-1]] == undisturbed[0]
    assert isinstance(events[-1], FinishEvent)
    assert len(batches) == 2 and len(batches[1]) >= 12  # the first read, then all the rest


def test_stream_interval_adapts_to_the_sequences_sampled():
    from scheduler_svc.output import STREAMS_PER_STEP, stream_interval

    assert [stream_interval(0, n) for n in (0, 1, STREAMS_PER_STEP, STREAMS_PER_STEP + 1,
                                            4 * STREAMS_PER_STEP)] == [1, 1, 1, 2, 4]
    assert stream_interval(3, 1) == 3 and stream_interval(1, 10_000) == 1


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stream_gets_its_first_token_at_once_then_every_interval_steps(undisturbed, interval):
    """A reader that keeps up: the first token alone, then `interval` tokens a batch, the end
    with what is left; the same tokens whatever the interval."""
    async def read(engine):
        return [b async for b in engine.generate_batches(SPECS[0])]

    batches = run(_on_engine(EngineConfig(stream_interval=interval), read))
    events = [e for b in batches for e in b]
    assert [e.token_id for e in events[:-1]] == undisturbed[0]
    assert isinstance(events[-1], FinishEvent)
    sizes = [len(b) for b in batches]
    assert sizes == ([1] * 11 + [2] if interval == 1 else [1, 4, 4, 4])  # 12 tokens + the end


@pytest.mark.parametrize("value, ok", [("-1", False), ("x", False), ("", False),
                                       ("0", True), ("4", True), ("1000000", True)])
def test_stream_interval_flag_refuses_what_is_not_a_count(value, ok):
    from scheduler_svc.main import parse_config

    if ok:
        assert parse_config(["--stream-interval", value]).engine.stream_interval == int(value)
    else:
        with pytest.raises(SystemExit):
            parse_config(["--stream-interval", value])


def test_the_mailbox_wakes_its_reader_only_when_asked_and_survives_a_cancelled_take():
    from scheduler_svc.output import Mailbox

    async def body():
        box = Mailbox()
        box.put("a", wake=False)
        take = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        assert not take.done()  # a put without wake leaves the reader waiting
        box.put("b")
        box.put("c")  # already woken: nothing more to do
        assert await take == ["a", "b", "c"]
        box.put("d")  # woken before the reader comes back: taken without waiting
        assert await asyncio.wait_for(box.take(), 0.1) == ["d"]
        cancelled = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        box.put("e")  # a reader that left does not swallow the wake
        assert await asyncio.wait_for(box.take(), 0.1) == ["e"]

    run(body())


def test_short_token_id_prompts_without_stop_strings_are_prepared_inline():
    from scheduler_svc.admission import INLINE_PREPARE_MAX_IDS, can_prepare_inline

    assert can_prepare_inline(spec(0))
    assert can_prepare_inline(GenerateSpec(prompt_token_ids=[5] * INLINE_PREPARE_MAX_IDS))
    assert not can_prepare_inline(GenerateSpec(prompt_token_ids=[5] * (INLINE_PREPARE_MAX_IDS + 1)))
    assert not can_prepare_inline(GenerateSpec(prompt_text="hello"))
    assert not can_prepare_inline(GenerateSpec(prompt_token_ids=[5, 6],
                                               stopping=StoppingParams(stop=("x",))))


def test_an_out_of_vocab_id_prepared_inline_is_refused_and_others_go_on(undisturbed):
    async def body(engine):
        bad = GenerateSpec(prompt_token_ids=[5, 10_000],
                           stopping=StoppingParams(max_tokens=2, ignore_eos=True))
        return await asyncio.gather(collect(engine, bad), collect(engine, SPECS[0]))

    refused, served = run(_on_engine(EngineConfig(), body))
    assert isinstance(refused, InvalidArgument)
    assert served == undisturbed[0]


def test_freeze_startup_heap_freezes_what_is_alive():
    """In a process of its own: freezing is for a service once ready, never a test process."""
    import subprocess
    import sys

    code = ("import gc; from scheduler_svc.main import freeze_startup_heap; "
            "n = freeze_startup_heap(); assert n == gc.get_freeze_count() > 1000, n; print(n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert int(out.stdout) > 1000


def test_the_heap_is_frozen_before_the_first_serving_and_only_then(monkeypatch):
    """A client that sends on SERVING must not wait for freeze_startup_heap's full collection:
    it happens before the first SERVING is reported, once per process (not again when a
    replacement executor attaches)."""
    from scheduler_svc import main

    calls = []
    monkeypatch.setattr(main, "freeze_startup_heap", lambda: calls.append("freeze") or 1)
    report = main._frozen_before_first_serving(lambda attached: calls.append(attached))
    for attached in (False, True, False, True):
        report(attached)
    assert calls == [False, "freeze", True, False, True]


@pytest.mark.parametrize("value, ok", [("0", False), ("4", False), ("-1", False), ("x", False),
                                       ("", False), ("99999999999999999999", False),
                                       ("1", True), ("3", True)])
def test_max_steps_in_flight_takes_only_the_supported_depths(value, ok, monkeypatch):
    """From the flag and from its environment variable alike (argparse checks no default)."""
    from scheduler_svc.main import parse_config

    if ok:
        assert parse_config(["--max-steps-in-flight", value]).engine.max_steps_in_flight == \
            int(value)
    else:
        with pytest.raises(SystemExit):
            parse_config(["--max-steps-in-flight", value])
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_MAX_STEPS_IN_FLIGHT", value)
    if ok:
        assert parse_config([]).engine.max_steps_in_flight == int(value)
    else:
        with pytest.raises(SystemExit):
            parse_config([])


# --- admission by sequences and deadlines; an executor lost while idle; a lease taken over -------

async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def started(client: FakeClient, config: EngineConfig):
    """(engine, health) while attached to `client`, stopped on exit; `health` lists each
    on_attached_change."""
    engine = Engine(config, client)
    health: list[bool] = []
    engine.on_attached_change = health.append
    await engine.start()
    try:
        await engine.wait_ready()
        yield engine, health
    finally:
        await engine.stop()


def wide(i: int, n: int, **kw) -> GenerateSpec:
    return dataclasses.replace(spec(i), n=n, **kw)


def test_admission_counts_every_sample_against_max_waiting():
    async def body():
        client = FakeClient()
        async with started(client, EngineConfig(SchedulerConfig(max_num_seqs=1),
                                                max_waiting=16)) as (engine, _):
            client.results_flow.clear()  # nothing finishes: what is admitted stays
            tasks = [asyncio.create_task(collect(engine, spec(0)))]
            await until(lambda: engine.scheduler.num_running == 1)
            tasks.append(asyncio.create_task(collect(engine, wide(1, 16))))
            await until(lambda: engine.num_requests == 17)
            assert engine.scheduler.num_waiting == 16
            refused = await collect(engine, spec(2))
            assert isinstance(refused, QueueFull), refused
            assert "16 sequences are waiting" in str(refused)
            assert "over --max-waiting (16)" in str(refused)
            assert 1 <= refused.retry_after_s <= 60
            assert engine.num_requests == 17  # nothing of the refused request stays
            client.results_flow.set()
            outputs = await asyncio.gather(*tasks)
            assert all(isinstance(o, list) for o in outputs)

    run(body())


def test_a_request_wider_than_the_bound_is_admitted_when_none_wait():
    async def body():
        async with started(FakeClient(), EngineConfig(max_waiting=4)) as (engine, _):
            tokens = [e async for e in engine.generate(wide(1, 8)) if isinstance(e, FinishEvent)]
            assert len(tokens) == 8

    run(body())


def test_a_request_the_queue_would_starve_past_its_deadline_is_refused_at_once():
    async def body():
        client = FakeClient()
        async with started(client, EngineConfig(SchedulerConfig(max_num_seqs=1))) as (engine, _):
            client.results_flow.clear()
            tasks = [asyncio.create_task(collect(engine, spec(i))) for i in range(5)]
            await until(lambda: engine.num_requests == 5)
            assert engine.scheduler.num_waiting == 4
            engine.scheduler.drain_rate = lambda: None  # not measured yet: never refused
            tasks.append(asyncio.create_task(
                collect(engine, wide(5, 1, deadline=time.monotonic() + 0.01))))
            await until(lambda: engine.num_requests == 6)
            engine.scheduler.drain_rate = lambda: 0.5  # a start every 2 s: 5 waiting take 10 s
            t0 = time.monotonic()
            refused = await collect(engine, wide(6, 1, deadline=time.monotonic() + 3))
            assert time.monotonic() - t0 < 0.5
            assert isinstance(refused, QueueFull) and "deadline" in str(refused), refused
            assert refused.retry_after_s in (7, 8)  # 10 s of queue less the 3 s it has
            for ok in (wide(7, 1, deadline=time.monotonic() + 30), spec(8)):  # time enough, none
                tasks.append(asyncio.create_task(collect(engine, ok)))
            await until(lambda: engine.num_requests == 8)
            client.results_flow.set()
            assert all(isinstance(o, list) for o in await asyncio.gather(*tasks))

    run(body())


def test_an_executor_lost_while_idle_is_noticed_at_once_and_requests_fail_after_the_grace():
    async def body():
        client = FakeClient()
        async with started(client, EngineConfig(unavailable_grace_s=0.5)) as (engine, health):
            assert isinstance(await collect(engine, spec(1)), list)
            assert engine.status().scheduler.gpu_blocks_cached > 0
            client.attachable.clear()  # the executor does not come back
            client.on_stream_end("its Execute stream ended: UNAVAILABLE: Socket closed")
            await until(lambda: not engine.attached, timeout=1)
            assert health == [True, False] and engine.num_resyncs == 1
            assert engine.status().scheduler.gpu_blocks_cached == 0  # its cache went with it
            t0 = time.monotonic()
            waited = await collect(engine, spec(2))  # admitted within the grace, then ended
            assert isinstance(waited, NoExecutor) and time.monotonic() - t0 < 2, waited
            t0 = time.monotonic()
            assert isinstance(await collect(engine, spec(3)), NoExecutor)  # past the grace
            assert time.monotonic() - t0 < 0.2
            client.attachable.set()
            await until(lambda: engine.attached)
            assert health == [True, False, True]
            assert isinstance(await collect(engine, spec(4)), list)

    run(body())


REFUSAL = ("executor fake:1 refused this scheduler's stream: FAILED_PRECONDITION: executor is "
           "leased by another scheduler")


class TakenOverClient(FakeClient):
    """While `leased`: results end the stream as a superseded one, and connect() is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.leased = False

    async def connect(self):
        while self.leased:
            self.on_refused(REFUSAL)
            await asyncio.sleep(0.05)
        return await super().connect()

    async def receive(self, plan):
        result = await super().receive(plan)
        if self.leased:
            raise self.lost("stream failed: ABORTED: superseded by a newer Execute stream")
        return result


def test_a_lease_taken_over_ends_the_streams_at_once_and_retries():
    async def body():
        client = TakenOverClient()
        async with started(client, EngineConfig(unavailable_grace_s=30)) as (engine, health):
            client.results_flow.clear()
            tasks = [asyncio.create_task(collect(engine, spec(i))) for i in range(4)]
            await until(lambda: engine.num_requests == 4)
            client.leased = True
            client.results_flow.set()
            t0 = time.monotonic()
            outputs = await asyncio.gather(*tasks)
            assert time.monotonic() - t0 < 2  # not the 30 s grace, nor the deadlines
            assert all(isinstance(o, NoExecutor) and "leased by another" in str(o)
                       for o in outputs), outputs
            status = engine.status()
            assert not status.attached and "leased by another" in status.attach_error
            assert health == [True, False]
            assert isinstance(await collect(engine, spec(5)), NoExecutor)  # refused at once
            assert status.scheduler.gpu_blocks_used == 0
            client.leased = False  # the other scheduler went away: retried, attached again
            await until(lambda: engine.attached)
            assert isinstance(await collect(engine, spec(6)), list)

    run(body())
