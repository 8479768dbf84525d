"""The executor's lease: the rules (one scheduler at a time, its own reconnect supersedes, takeover
only with a token), the bounded wait for a stream's hello, and the Executor service over gRPC in
process on a fake runner: garbage, silent, refused, evicted and already-gone streams never touch
the runner or the lease holder, and open streams of other kinds leave Describe a thread."""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from executor_svc.lease import Hello, Lease, LeaseRefused
from executor_svc.rpc_slots import WaitingStreams
from executor_svc.server import (MAX_WAITING_STREAMS, ExecutorServicer, build_server,
                                 hello_from_proto)
from executor_svc.step import ExecutorInfo, StepResult
from executor_svc.transport import AddressInUse, TransportConfig, check_can_listen
from protos import executor_pb2, executor_pb2_grpc

TIMEOUT_S = 30


# --- the rules ----------------------------------------------------------------------------------

class Stream:
    """A holder's stream as the Lease sees it: alive until ended; records being superseded."""

    def __init__(self) -> None:
        self.alive, self.superseded = True, 0

    def grant(self, lease: Lease, hello: Hello) -> int:
        return lease.grant(hello, lambda: self.alive, self._supersede)

    def _supersede(self) -> None:
        self.superseded += 1


def test_one_scheduler_at_a_time_until_its_stream_is_gone():
    lease, a, b = Lease(allow_takeover=False, clock=lambda: 0.0), Stream(), Stream()
    generation = a.grant(lease, Hello("a", 1))
    with pytest.raises(LeaseRefused, match=r"leased by another scheduler \(id a, since .*refused "
                                           "until that stream ends"):
        b.grant(lease, Hello("b", 1))
    assert lease.is_current(generation) and lease.holder == Hello("a", 1)
    a.alive = False  # gone, though its handler has not released yet
    assert b.grant(lease, Hello("b", 1)) == generation + 1
    assert a.superseded == 1 and not lease.is_current(generation)


def test_released_lease_is_free_and_a_stale_release_is_ignored():
    lease, a, b = Lease(allow_takeover=False), Stream(), Stream()
    first = a.grant(lease, Hello("a", 1))
    lease.release(first)
    assert lease.holder is None
    second = b.grant(lease, Hello("b", 1))
    lease.release(first)  # an old stream's late end does not free the new holder
    assert lease.is_current(second) and lease.holder.scheduler_id == "b"


def test_the_same_scheduler_supersedes_itself_with_a_higher_epoch_only():
    lease, old, new = Lease(allow_takeover=False), Stream(), Stream()
    old.grant(lease, Hello("a", 5))
    for epoch in (5, 4):
        with pytest.raises(LeaseRefused, match="stale hello"):
            new.grant(lease, Hello("a", epoch))
    assert old.superseded == 0
    generation = new.grant(lease, Hello("a", 6))
    assert old.superseded == 1 and lease.is_current(generation)


def test_takeover_only_where_callers_are_authenticated():
    lease, a, b = Lease(allow_takeover=False), Stream(), Stream()
    a.grant(lease, Hello("a", 1))
    with pytest.raises(LeaseRefused, match="takeover needs an executor started with an auth token"):
        b.grant(lease, Hello("b", 1, takeover=True))
    lease, a = Lease(allow_takeover=True), Stream()
    a.grant(lease, Hello("a", 1))
    generation = b.grant(lease, Hello("b", 1, takeover=True))
    assert a.superseded == 1 and lease.is_current(generation)


def test_waiting_streams_beyond_the_limit_close_the_oldest():
    closed = []
    waiting = WaitingStreams(limit=2)
    keys = [waiting.add(lambda i=i: closed.append(i)) for i in range(4)]
    assert closed == [0, 1] and len(waiting) == 2
    assert not waiting.remove(keys[0])  # evicted: its owner must not go on
    assert waiting.remove(keys[3]) and len(waiting) == 1


def test_waiting_streams_evict_from_the_most_crowded_connection():
    """A connection's one waiting call outlives newer calls of a crowded connection."""
    closed = []
    waiting = WaitingStreams(limit=3)
    waiting.add(lambda: closed.append("scheduler"), peer="ipv4:127.0.0.1:1000")
    for i in range(10):
        waiting.add(lambda i=i: closed.append(i), peer="ipv4:127.0.0.1:2000")
    assert closed == list(range(8)) and len(waiting) == 3
    other = waiting.add(lambda: closed.append("other"), peer="ipv4:127.0.0.1:3000")
    assert closed[-1] == 8  # the crowded one still pays
    waiting.add(lambda: closed.append("newest"), peer="ipv4:127.0.0.1:4000")
    assert closed[-1] == "scheduler"  # every connection waits for one call: the oldest goes
    assert waiting.remove(other)


def lease_msg(scheduler_id="s", epoch=1, takeover=False,
              protocol_version=executor_pb2.PROTOCOL_VERSION):
    return executor_pb2.Lease(scheduler_id=scheduler_id, epoch=epoch, takeover=takeover,
                              protocol_version=protocol_version)


@pytest.mark.parametrize("plan", [
    None,
    executor_pb2.StepPlan(),
    executor_pb2.StepPlan(step_id=1),
    executor_pb2.StepPlan(lease=lease_msg(scheduler_id="")),
    executor_pb2.StepPlan(lease=lease_msg(epoch=0)),
    executor_pb2.StepPlan(step_id=1, lease=lease_msg()),
    executor_pb2.StepPlan(lease=lease_msg(), finished_seq_ids=[3]),
], ids=["none", "empty", "a-plan", "no-id", "epoch-0", "step-1", "with-a-plan"])
def test_a_hello_is_step_0_with_a_lease_and_nothing_else(plan):
    assert hello_from_proto(plan) is None


def test_a_hello_carries_id_epoch_and_takeover():
    assert hello_from_proto(executor_pb2.StepPlan(lease=lease_msg("x", 3, True))) == \
        Hello("x", 3, True)


# --- the service ----------------------------------------------------------------------------------

@dataclass
class _Done:
    step_id: int
    step: object

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class FakeRunner:
    """Counts resets; each step samples token 7 for its new seqs."""

    def __init__(self) -> None:
        self.resets = 0
        self.info = ExecutorInfo("fake", "fp", "float32", 4, 16, 0, 64, 100, "", "cpu")

    def reset(self) -> None:
        self.resets += 1

    def idle(self) -> None:
        pass

    def launch(self, step) -> _Done:
        return _Done(step.step_id, step)

    def finish(self, pending: _Done) -> StepResult:
        seq_ids = np.array([s.seq_id for s in pending.step.new_seqs], dtype=np.uint64)
        return StepResult(pending.step_id, seq_ids, np.full(len(seq_ids), 7), 0.0, 0.0)


def hello(scheduler_id="holder", epoch=1, takeover=False) -> executor_pb2.StepPlan:
    return executor_pb2.StepPlan(lease=lease_msg(scheduler_id, epoch, takeover))


def plan(step_id: int) -> executor_pb2.StepPlan:
    return executor_pb2.StepPlan(step_id=step_id, new_seqs=[executor_pb2.NewSeq(
        seq_id=step_id, token_ids=[1, 2], block_table=[0], num_scheduled_tokens=2)])


class Call:
    """One Execute call: `first` messages are sent at once, more with send()."""

    def __init__(self, channel, *first, metadata=()) -> None:
        self.plans: queue.SimpleQueue = queue.SimpleQueue()
        for message in first:
            self.plans.put(message)
        stub = executor_pb2_grpc.ExecutorStub(channel)
        self.responses = stub.Execute(iter(self.plans.get, None), timeout=TIMEOUT_S,
                                      metadata=metadata)

    def send(self, message) -> None:
        self.plans.put(message)

    def receive(self) -> executor_pb2.StepResult:
        return next(self.responses)

    def status(self) -> grpc.RpcError:
        """The error that ends the call (after any results)."""
        with pytest.raises(grpc.RpcError) as err:
            while True:
                self.receive()
        self.plans.put(None)
        return err.value

    def close(self) -> None:
        """Half-closes; returns once the executor has ended the stream (and released its lease)."""
        self.plans.put(None)
        assert list(self.responses) == []


class Served:
    def __init__(self, **transport) -> None:
        self.runner = FakeRunner()
        self.server, self.port = build_server(self.runner, "127.0.0.1:0",
                                              TransportConfig(**transport))
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def attach(self, *args, **kwargs) -> Call:
        call = Call(self.channel, hello(*args, **kwargs))
        assert call.receive().step_id == 0
        return call

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(None)


@pytest.fixture()
def served():
    served = Served(hello_timeout_s=0.5)
    yield served
    served.stop()


def test_rogue_streams_never_touch_the_runner_or_the_holder(served):
    holder = served.attach()
    holder.send(plan(1))
    assert holder.receive().step_id == 1
    garbage = [Call(served.channel, m) for m in
               (plan(1), executor_pb2.StepPlan(), hello(epoch=0), plan(0))]
    silent = Call(served.channel)
    stranger = Call(served.channel, hello("stranger"))
    stale = Call(served.channel, hello("holder", epoch=1))
    for call in garbage:
        err = call.status()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease hello" in err.details()
    assert silent.status().code() == grpc.StatusCode.DEADLINE_EXCEEDED
    err = stranger.status()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "leased by another scheduler (id holder, since" in err.details()
    assert "stale hello" in stale.status().details()
    holder.send(plan(2))
    assert list(holder.receive().sampled.seq_ids) == [2]
    assert served.runner.resets == 1  # the holder's own grant, nothing else
    holder.close()
    served.attach("stranger").close()  # free once the holder's stream ended


def test_a_hello_of_another_protocol_version_is_refused_naming_both(served):
    """A scheduler of another release (0: one that names no version) would misread results."""
    for version in (0, executor_pb2.PROTOCOL_VERSION + 1):
        err = Call(served.channel,
                   executor_pb2.StepPlan(lease=lease_msg(protocol_version=version))).status()
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (f"the scheduler speaks executor protocol version {version}, this executor "
                f"version {executor_pb2.PROTOCOL_VERSION}") in err.details()
    assert served.runner.resets == 0
    served.attach().close()  # the lease is free


def test_a_later_plan_may_not_carry_a_lease(served):
    holder = served.attach()
    holder.send(executor_pb2.StepPlan(step_id=1, lease=lease_msg("holder", 9)))
    err = holder.status()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "carries a lease" in err.details()


class _Aborted(Exception):
    pass


class GoneContext:
    """A servicer context whose client already left (its stream sat queued, then was cancelled)."""

    def is_active(self) -> bool:
        return False

    def abort(self, code, details):
        raise _Aborted(code)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_a_hello_from_a_client_already_gone_never_resets_the_runner():
    runner = FakeRunner()
    servicer = ExecutorServicer(runner)
    with pytest.raises(_Aborted):
        next(servicer.Execute(iter([hello()]), GoneContext()))
    assert runner.resets == 0 and servicer.lease.holder is None


def test_streams_waiting_for_a_hello_are_bounded_and_never_keep_a_scheduler_out():
    served = Served(hello_timeout_s=TIMEOUT_S)  # idle streams stay until evicted or cancelled
    try:
        idle = [Call(served.channel) for _ in range(2 * MAX_WAITING_STREAMS)]
        ended: queue.SimpleQueue = queue.SimpleQueue()
        for call in idle:
            call.responses.add_done_callback(lambda c: ended.put(c.code()))
        evicted = [ended.get(timeout=TIMEOUT_S) for _ in range(MAX_WAITING_STREAMS)]
        assert evicted == [grpc.StatusCode.RESOURCE_EXHAUSTED] * MAX_WAITING_STREAMS
        start = time.monotonic()
        executor_pb2_grpc.ExecutorStub(served.channel).Describe(
            executor_pb2.DescribeRequest(), timeout=5)
        holder = served.attach()  # a newcomer with its hello is let in at once
        holder.send(plan(1))
        assert holder.receive().step_id == 1
        assert time.monotonic() - start < 5
        for call in idle:
            call.responses.cancel()
        holder.close()
    finally:
        served.stop()


def test_open_reflection_and_watch_streams_leave_describe_and_execute_free(served):
    reflection = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    blocked: queue.SimpleQueue = queue.SimpleQueue()
    streams = [reflection.ServerReflectionInfo(iter(blocked.get, None), timeout=TIMEOUT_S)
               for _ in range(40)]
    health = health_pb2_grpc.HealthStub(served.channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S) for _ in range(40)]
    for watch in watches:
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    ended: queue.SimpleQueue = queue.SimpleQueue()
    for stream in streams:
        stream.add_done_callback(lambda call: ended.put(call.code()))
    refused = [ended.get(timeout=TIMEOUT_S) for _ in range(36)]  # all but the 4 allowed
    assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 36
    executor_pb2_grpc.ExecutorStub(served.channel).Describe(executor_pb2.DescribeRequest(),
                                                            timeout=5)
    served.attach().close()
    assert ended.empty()
    blocked.put(None)
    for call in streams + watches:
        call.cancel()


def test_a_second_server_on_a_busy_port_fails_to_bind(served):
    port = served.port
    with pytest.raises(AddressInUse, match=f"cannot listen on 127.0.0.1:{port}"):
        build_server(FakeRunner(), f"127.0.0.1:{port}")
    with pytest.raises(AddressInUse, match=f"cannot listen on 127.0.0.1:{port}"):
        check_can_listen("127.0.0.1", port)


def test_takeover_supersedes_the_holder_only_with_a_token():
    served = Served(auth_token="secret")
    token = (("authorization", "Bearer secret"),)
    try:
        holder = Call(served.channel, hello("a"), metadata=token)
        assert holder.receive().step_id == 0
        taker = Call(served.channel, hello("b", takeover=True), metadata=token)
        assert taker.receive().step_id == 0
        assert holder.status().code() == grpc.StatusCode.ABORTED
        taker.send(plan(1))
        assert taker.receive().step_id == 1
        assert served.runner.resets == 2
    finally:
        served.stop()
