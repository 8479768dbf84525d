"""The executor serves one scheduler at a time, whatever else connects: real processes on localhost.

Rogue Execute streams (idle, garbage, strangers' hellos, hellos cancelled at once) and a second
scheduler are refused while the first scheduler's outputs stay token-identical with no resync; a
scheduler attaches past idle streams; an idle link outlives its keepalive pings; a second executor
on a busy port exits at start.
"""
from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest

from protos import executor_pb2, executor_pb2_grpc
from scheduler_svc.executor_client import ExecutorClient
from scheduler_svc.plan import CachedSeqs, NewSeqPlan, StepPlan
from scheduler_svc.sampling_params import SamplingParams
from tests.integration.harness import (attach_scheduler, free_port, generate, start_executor,
                                       start_services, wait_serving)
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_end_to_end import TINY, random_prompts
from tests.integration.test_resilience import Load

pytestmark = pytest.mark.slow

RESYNCS = "pagedserve_executor_resyncs_total"


def stranger_hello() -> executor_pb2.StepPlan:
    return executor_pb2.StepPlan(lease=executor_pb2.Lease(
        scheduler_id=uuid.uuid4().hex, epoch=1, protocol_version=executor_pb2.PROTOCOL_VERSION))


GARBAGE = [executor_pb2.StepPlan(), executor_pb2.StepPlan(step_id=1),
           executor_pb2.StepPlan(step_id=7, finished_seq_ids=[1, 2]),
           executor_pb2.StepPlan(lease=executor_pb2.Lease(epoch=1))]


class RogueCall:
    """An Execute call that sends `first` (or nothing) and then stays open; `code()` waits for
    the status the executor ends it with."""

    def __init__(self, channel: grpc.Channel, first=None) -> None:
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        if first is not None:
            self._plans.put(first)
        stub = executor_pb2_grpc.ExecutorStub(channel)
        self.call = stub.Execute(iter(self._plans.get, None), timeout=60)

    def code(self) -> grpc.StatusCode:
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass
        self._plans.put(None)
        return self.call.code()


class SecondScheduler:
    """Another scheduler process on the same executor; its log lines are read as they come. Its
    retry interval has it take the lease as soon as the lease is free."""

    def __init__(self, executor_address: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "scheduler_svc.main", "--host", "127.0.0.1", "--port",
               self.address.rsplit(":", 1)[1], "--admin-port", str(free_port()), "--http-port",
               "0", "--executor", executor_address, "--executor-retry-interval", "0.2"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def wait_for_line(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            if needle in line:
                return line

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_rogue_streams_neither_stall_nor_disturb_the_scheduler(tmp_path):
    services = start_services(tmp_path, ["--model", TINY, "--hello-timeout", "2"],
                              ["--max-num-seqs", "8"])
    try:
        with grpc.insecure_channel(services.executor_address) as channel:
            idle = [RogueCall(channel) for _ in range(16)]
            load = Load(services.scheduler_address, random_prompts(16, seed=11), max_tokens=48,
                        reference=TINY)
            load.wait_tokens(100)
            garbage = [RogueCall(channel, GARBAGE[i % len(GARBAGE)]) for i in range(16)]
            strangers = [RogueCall(channel, stranger_hello()) for _ in range(8)]
            quitters = [RogueCall(channel, stranger_hello()) for _ in range(8)]
            for rogue in quitters:  # gone before the executor may even have read the hello
                rogue.call.cancel()
            load.check_against_reference()
            busy = grpc.StatusCode.RESOURCE_EXHAUSTED  # evicted by newer idle streams
            assert {r.code() for r in idle} <= {grpc.StatusCode.DEADLINE_EXCEEDED, busy}
            assert {r.code() for r in garbage} <= {grpc.StatusCode.INVALID_ARGUMENT, busy}
            assert {r.code() for r in strangers} <= {grpc.StatusCode.FAILED_PRECONDITION, busy}
        assert services.metrics()[RESYNCS] == 0
        log = services.log_of("executor")
        assert log.count("granted") == 1 and "leased by another scheduler" in log
    finally:
        services.stop()


def test_a_second_scheduler_is_refused_until_the_first_is_gone(tmp_path, tiny_executor):
    services = attach_scheduler(tmp_path, tiny_executor, ["--max-num-seqs", "8"])
    second = SecondScheduler(services.executor_address)
    try:
        refusal = second.wait_for_line("refused this scheduler's stream")
        assert "FAILED_PRECONDITION: executor is leased by another scheduler" in refusal
        load = Load(services.scheduler_address, random_prompts(16, seed=22), max_tokens=48,
                    reference=TINY)
        load.check_against_reference()  # while the second one keeps retrying
        assert services.metrics()[RESYNCS] == 0
        services.procs["scheduler"].kill()
        services.procs["scheduler"].wait()
        wait_serving(second.address, timeout=60)  # its stream gone, the lease is free
        prompt = random_prompts(1, seed=23)[0]
        with grpc.insecure_channel(second.address) as channel:
            ids, _, _ = generate(services.stub(channel), prompt, max_tokens=16)
        assert ids == hf_greedy(TINY, prompt, 16)
    finally:
        second.stop()
        services.stop()


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    """One executor process whose idle streams wait up to 30 s for their hello."""
    port = free_port()
    log = tmp_path_factory.mktemp("lease") / "executor.log"
    proc = start_executor(["--model", TINY, "--hello-timeout", "30"], port, str(log))
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    yield address, port, log.parent
    proc.terminate()
    proc.wait(timeout=30)


def test_a_scheduler_attaches_past_idle_streams(executor):
    address, _, _ = executor

    async def attach() -> float:
        client = ExecutorClient([address])
        start = time.monotonic()
        assert await client.connect_once() is not None
        elapsed = time.monotonic() - start
        await client.close()
        return elapsed

    with grpc.insecure_channel(address) as channel:
        idle = [RogueCall(channel) for _ in range(16)]
        assert asyncio.run(attach()) < 3  # not after the idle streams' 30 s
        for rogue in idle:
            rogue.call.cancel()


def test_an_idle_link_outlives_keepalive_pings(executor):
    """1 s pings through a 6 s idle spell: the executor's default ping policy (one per 5 min,
    2 strikes) answers the fourth with GOAWAY too_many_pings and the stream breaks."""
    address, _, _ = executor
    first = StepPlan(1, new_seqs=[NewSeqPlan(1, [5, 6, 7], [0], 0, 3, SamplingParams(), 0)])
    second = StepPlan(2, cached_seqs=CachedSeqs.of([(1, 1, 3, [])]))

    async def run() -> None:
        client = ExecutorClient([address], keepalive_s=1.0)
        await client.connect()
        for plan in (first, second):
            if plan is second:
                await asyncio.sleep(6)  # the idle spell under test: nothing to await
            await client.send(plan)
            assert list((await client.receive(plan)).sampled) == [1]
        assert client.disconnected_since is None
        await client.close()

    asyncio.run(run())


def test_a_second_executor_on_a_busy_port_exits_at_start(executor):
    _, port, log_dir = executor
    log = log_dir / "second.log"
    proc = start_executor(["--model", TINY], port, str(log))
    assert proc.wait(timeout=60) != 0
    assert f"cannot listen on 127.0.0.1:{port}" in log.read_text()
