"""The Execute stream over gRPC in process, with steps overlapped and one at a time: the same
results for the real scheduler's plans (two in flight), results in step order, and the failure
rules: a rejected plan answers FAILED_PRECONDITION after the result of the step before it, a
failing step INTERNAL, both dropping the executor's state; the same scheduler's newer stream aborts
its older one. Every stream opens with a lease hello (tests/executor_svc/test_lease.py has the
lease rules)."""
from __future__ import annotations

import itertools
import queue

import grpc
import pytest

from executor_svc.config import ExecutorConfig
from executor_svc.server import build_server
from executor_svc.worker import Worker
from protos import executor_pb2, executor_pb2_grpc
from tests.executor_svc.helpers import ScheduledRun, add_workload, make_scheduler

TIMEOUT_S = 120
_EPOCHS = itertools.count(1)


def hello(scheduler_id: str = "test-scheduler", epoch: int | None = None, **fields):
    epoch = next(_EPOCHS) if epoch is None else epoch
    return executor_pb2.StepPlan(lease=executor_pb2.Lease(scheduler_id=scheduler_id, epoch=epoch,
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

    def receive(self) -> executor_pb2.StepResult:
        return next(self._results)

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
        cached_seqs=[executor_pb2.CachedSeq(seq_id=s, num_scheduled_tokens=1,
                                            num_computed_tokens=step_id + 1) for s in cached])


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
    assert served.runner.seqs == {} and served.runner.num_pending_steps == 0


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
    assert served.runner.seqs == {} and served.runner.num_pending_steps == 0


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
