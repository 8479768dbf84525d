"""The Execute stream over gRPC in process, with steps overlapped and one at a time: the same
results for the real scheduler's plans (two in flight), results in step order, and the failure
rules: a rejected plan answers FAILED_PRECONDITION after the result of the step before it, a
failing step INTERNAL, both dropping the executor's state; the same scheduler's newer stream aborts
its older one. Every stream opens with a lease hello (tests/executor_svc/test_lease.py has the
lease rules)."""
from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from executor_svc.config import ExecutorConfig
from executor_svc.server import SERVICE_NAME, build_server
from executor_svc.step import StepResult
from executor_svc.worker import Worker
from protos import executor_pb2, executor_pb2_grpc, reflection
from tests.executor_svc.helpers import ScheduledRun, add_workload, make_scheduler
from tests.executor_svc.test_lease import Call as LeaseCall
from tests.executor_svc.test_lease import Served as LeaseServed
from tests.executor_svc.test_lease import hello as lease_hello
from tests.executor_svc.test_lease import plan as lease_plan

TIMEOUT_S = 120
_EPOCHS = itertools.count(1)


def hello(scheduler_id: str = "test-scheduler", epoch: int | None = None, **fields):
    epoch = next(_EPOCHS) if epoch is None else epoch
    return executor_pb2.StepPlan(lease=executor_pb2.Lease(
        scheduler_id=scheduler_id, epoch=epoch, protocol_version=executor_pb2.PROTOCOL_VERSION,
        **fields))


class GrpcLink:
    """One Execute stream as ScheduledRun's executor: send() writes a plan, receive() reads the
    next result. It opens with a hello from one test scheduler (each link a new epoch) and reads
    the ack."""

    def __init__(self, channel: grpc.Channel, first=None) -> None:
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        stub = executor_pb2_grpc.ExecutorStub(channel)
        self._results = stub.Execute(iter(self._plans.get, None), timeout=TIMEOUT_S)
        self.send(hello() if first is None else first)
        assert self.receive().step_id == 0

    def send(self, message: executor_pb2.StepPlan) -> None:
        self._plans.put(message)

    def receive(self) -> StepResult:
        """The next result as the executor built it (logprobs left out)."""
        msg = next(self._results)
        return StepResult(msg.step_id, np.array(msg.sampled.seq_ids, dtype=np.uint64),
                          np.array(msg.sampled.token_ids, dtype=np.int64), msg.forward_ms,
                          msg.step_ms)

    def close(self) -> None:
        self._plans.put(None)


class Served:
    def __init__(self, overlap: bool) -> None:
        self.runner = Worker(ExecutorConfig(model="preset:tiny", block_size=4, num_gpu_blocks=12,
                                            swap_space_gib=0.0005)).runner
        self.launched_with_pending = 0  # launches while an earlier step was unfinished
        launch = self.runner.launch

        def counting_launch(step):
            self.launched_with_pending += self.runner.num_pending_steps > 0
            return launch(step)

        self.runner.launch = counting_launch
        self.server, port = build_server(self.runner, "127.0.0.1:0", overlap_steps=overlap)
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def stream(self) -> GrpcLink:
        return GrpcLink(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(None)


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "one-at-a-time"])
def served(request):
    served = Served(request.param)
    yield served
    served.stop()


def plan(step_id: int, new=(), cached=()) -> executor_pb2.StepPlan:
    """Seqs of prompt [5, 6, 7] in blocks 3s..3s+2; a cached seq decodes one token (at
    position step_id + 1: its prompt came in step 1)."""
    return executor_pb2.StepPlan(
        step_id=step_id,
        new_seqs=[executor_pb2.NewSeq(seq_id=s, token_ids=[5, 6, 7],
                                      block_table=[3 * s, 3 * s + 1, 3 * s + 2],
                                      num_computed_tokens=0, num_scheduled_tokens=3)
                  for s in new],
        cached=executor_pb2.CachedSeqs(seq_ids=cached, num_scheduled_tokens=[1] * len(cached),
                                       num_computed_tokens=[step_id + 1] * len(cached),
                                       num_new_blocks=[0] * len(cached)))


def test_overlap_on_and_off_give_the_same_results():
    results = {}
    for overlap in (True, False):
        served = Served(overlap)
        try:
            sched = make_scheduler(served.runner.info, max_num_batched_tokens=16, max_num_seqs=6)
            add_workload(sched, seed=4)
            link = served.stream()
            run = ScheduledRun(sched, link).run()
            link.close()
            results[overlap] = run.results
            assert sched.num_preemptions_swap > 0
            if not overlap:
                assert served.launched_with_pending == 0
        finally:
            served.stop()
    assert results[True] == results[False]
    assert [step_id for step_id, _ in results[True]] == list(range(1, len(results[True]) + 1))


def test_results_come_in_step_order_with_plans_sent_ahead(served):
    link = served.stream()
    link.send(plan(1, new=[1, 2]))
    for step_id in range(2, 6):
        link.send(plan(step_id, cached=[1, 2]))
    results = [link.receive() for _ in range(5)]
    link.close()
    assert [r.step_id for r in results] == [1, 2, 3, 4, 5]
    assert all([t.seq_id for t in r.sampled] == [1, 2] for r in results)
    assert all(r.step_ms >= r.forward_ms > 0 for r in results)


def test_rejected_plan_after_the_result_of_the_step_before_it(served):
    link = served.stream()
    link.send(plan(1, new=[1]))
    link.send(plan(2, cached=[99]))  # unknown seq, sent before step 1's result is read
    assert link.receive().step_id == 1
    with pytest.raises(grpc.RpcError) as err:
        link.receive()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cached seq 99" in err.value.details()
    assert not len(served.runner.input_batch) and served.runner.num_pending_steps == 0


def test_failing_step_answers_internal_and_drops_state(served, monkeypatch):
    model = served.runner.model
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("forward broke")
        return type(model).forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    link = served.stream()
    link.send(plan(1, new=[1]))
    link.send(plan(2, cached=[1]))
    assert link.receive().step_id == 1
    with pytest.raises(grpc.RpcError) as err:
        link.receive()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "step 2 failed" in err.value.details() and "forward broke" in err.value.details()
    assert not len(served.runner.input_batch) and served.runner.num_pending_steps == 0


def test_a_newer_stream_of_the_same_scheduler_aborts_the_older_one(served):
    old = served.stream()
    old.send(plan(1, new=[1]))
    assert old.receive().step_id == 1  # returned although no next plan was sent
    new = served.stream()
    new.send(plan(1, new=[3]))
    assert new.receive().step_id == 1
    old.send(plan(2, cached=[1]))
    with pytest.raises(grpc.RpcError) as err:
        old.receive()
    assert err.value.code() == grpc.StatusCode.ABORTED
    new.send(plan(2, cached=[3]))
    assert new.receive().step_id == 2
    new.close()


# --- the RPC slots: calls that never send a message ---------------------------------------------

SLOT_METHODS = {  # method: whether its responses stream
    f"/{SERVICE_NAME}/Describe": False, f"/{SERVICE_NAME}/Execute": True,
    "/grpc.health.v1.Health/Check": False, "/grpc.health.v1.Health/Watch": True,
    **{method: True for method in reflection.METHODS},
}
TOKEN = (("authorization", "Bearer secret"),)


class SilentCall:
    """A call of `method` that sends its headers and never a message: its request stream blocks
    until the test ends. `ended` gets its status code once the server ends it."""

    def __init__(self, channel, method: str, streaming: bool, ended: queue.SimpleQueue,
                 metadata=()) -> None:
        self._release = threading.Event()
        open_call = channel.stream_stream(method) if streaming else channel.stream_unary(method)
        if not streaming:
            open_call = open_call.future
        self.call = open_call(self._requests(), timeout=TIMEOUT_S, metadata=metadata)
        self.call.add_done_callback(lambda call: ended.put((method, call.code())))

    def _requests(self):
        self._release.wait()
        return
        yield

    def release(self) -> None:
        self._release.set()
        self.call.cancel()


@contextlib.contextmanager
def silent_calls(port: int, per_method: int, metadata=()):
    """`per_method` silent calls of every method, each method on connections of its own (a
    connection carries at most 100 open calls); yields the queue of their end codes."""
    ended: queue.SimpleQueue = queue.SimpleQueue()
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in SLOT_METHODS]
    calls = [SilentCall(channel, method, streaming, ended, metadata)
             for channel, (method, streaming) in zip(channels, SLOT_METHODS.items())
             for _ in range(per_method)]
    try:
        yield ended
    finally:
        for call in calls:
            call.release()
        for channel in channels:
            channel.close()


def served_fake(**transport) -> LeaseServed:
    served = LeaseServed(**transport)
    served.channel.close()
    served.channel = grpc.insecure_channel(f"127.0.0.1:{served.port}",
                                           options=[("grpc.use_local_subchannel_pool", 1)])
    return served


def _serving_within(channel, seconds: float, metadata=()) -> None:
    """Describe, health and a reconnecting holder's hello answer within `seconds`."""
    start = time.monotonic()
    executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(),
                                                     timeout=seconds, metadata=metadata)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=seconds, metadata=metadata)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    holder = LeaseCall(channel, lease_hello("holder", epoch=int(start * 1000)), metadata=metadata)
    assert holder.receive().step_id == 0
    holder.send(lease_plan(1))
    assert holder.receive().step_id == 1
    assert time.monotonic() - start < seconds
    holder.close()


@pytest.mark.parametrize("metadata", [(), TOKEN], ids=["no-token", "token"])
def test_silent_calls_of_every_method_leave_the_scheduler_served(metadata):
    """40 silent calls of each method (more than the server's threads once were): the holder's
    stream goes on, and Describe, health and the holder's reconnect answer at once; the silent
    calls end within the first-message deadline (evicted or timed out), or with a token configured
    those without it at once."""
    served = served_fake(hello_timeout_s=2, auth_token="secret" if metadata else None)
    try:
        holder = LeaseCall(served.channel, lease_hello("holder"), metadata=metadata)
        assert holder.receive().step_id == 0
        with silent_calls(served.port, 40) as ended:
            start = time.monotonic()
            holder.send(lease_plan(1))
            assert holder.receive().step_id == 1
            _serving_within(served.channel, 1.0, metadata)
            codes = [ended.get(timeout=10) for _ in range(40 * len(SLOT_METHODS))]
            assert time.monotonic() - start < 2 + 3
        allowed = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
        for method, code in codes:
            guarded = method.startswith(f"/{SERVICE_NAME}/")
            assert code in ({grpc.StatusCode.UNAUTHENTICATED} if metadata and guarded
                            else allowed), (method, code)
        assert ended.empty()
    finally:
        served.stop()


def test_a_call_without_its_first_message_ends_at_the_deadline():
    served = served_fake(hello_timeout_s=0.5)
    try:
        start = time.monotonic()  # before the calls: their deadlines start after it
        with silent_calls(served.port, 1) as ended:
            codes = dict(ended.get(timeout=10) for _ in SLOT_METHODS)
            assert 0.5 <= time.monotonic() - start < 3
        assert set(codes.values()) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    finally:
        served.stop()


def test_describe_and_execute_without_the_token_are_refused_before_their_message():
    served = served_fake(hello_timeout_s=60, auth_token="secret")
    try:
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            with silent_calls(served.port, 1, metadata) as ended:
                guarded = [ended.get(timeout=5) for _ in range(2)]
            assert sorted(guarded) == [(f"/{SERVICE_NAME}/{m}", grpc.StatusCode.UNAUTHENTICATED)
                                       for m in ("Describe", "Execute")]
    finally:
        served.stop()


def _first_reply(stream) -> str:
    try:
        return "answered" if next(stream).list_services_response.service else "empty"
    except grpc.RpcError as err:
        return err.code().name


def test_open_reflection_streams_are_capped_apart_from_describe():
    served = served_fake(hello_timeout_s=60)
    reflection_stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    blocked: queue.SimpleQueue = queue.SimpleQueue()
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        streams = [reflection_stub.ServerReflectionInfo(itertools.chain([request],
                                                                        iter(blocked.get, None)),
                                                        timeout=TIMEOUT_S) for _ in range(5)]
        outcomes = [_first_reply(stream) for stream in streams]
        assert sorted(outcomes) == ["RESOURCE_EXHAUSTED"] + ["answered"] * 4
        _serving_within(served.channel, 1.0)
        for stream in streams:
            stream.cancel()
    finally:
        served.stop()
