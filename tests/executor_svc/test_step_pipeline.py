"""StepPipeline on a fake runner whose "GPU" finishes a step only when told or when waited for:
step N+1 is launched before step N is finished when its plan is there, at most two steps are
unfinished, results come in step order, a finished step is never held back for a plan nor for
the launch of another, and a failing step comes after the results of the steps launched before
it."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from executor_svc.step import PlanMismatch
from executor_svc.step_pipeline import StepFailed, StepPipeline

TIMEOUT_S = 10


@dataclass(frozen=True)
class Plan:
    step_id: int


class FakePending:
    def __init__(self, step_id: int, ready: bool) -> None:
        self.step_id = step_id
        self.done = threading.Event()
        if ready:
            self.done.set()

    def is_ready(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        assert self.done.wait(TIMEOUT_S), f"step {self.step_id} never completed"


class FakeRunner:
    """Records launch/finish calls. `slow`: a step's GPU work ends only when finish() waits for it
    (the GPU is always still busy when the next plan is checked) or when complete() is called;
    else it is done at launch, as on the CPU backend."""

    def __init__(self, slow: bool = True, fail_launch: int | None = None,
                 fail_finish: int | None = None) -> None:
        self.slow, self.fail_launch, self.fail_finish = slow, fail_launch, fail_finish
        self.calls: list[str] = []
        self.launched: queue.SimpleQueue = queue.SimpleQueue()
        self.max_unfinished = 0
        self._unfinished = 0

    def launch(self, plan: Plan) -> FakePending:
        if plan.step_id == self.fail_launch:
            raise PlanMismatch(f"step {plan.step_id} is bad")
        self.calls.append(f"L{plan.step_id}")
        self._unfinished += 1
        self.max_unfinished = max(self.max_unfinished, self._unfinished)
        pending = FakePending(plan.step_id, ready=not self.slow)
        self.launched.put(pending)
        return pending

    def finish(self, pending: FakePending) -> int:
        pending.done.set()  # the sync: the GPU gets there
        self._unfinished -= 1
        if pending.step_id == self.fail_finish:
            raise RuntimeError("device error")
        self.calls.append(f"F{pending.step_id}")
        return pending.step_id


def pipeline(runner: FakeRunner, max_launched: int = 2) -> StepPipeline:
    return StepPipeline(runner.launch, runner.finish, max_launched)


class Plans:
    """A plan stream the test writes to while the pipeline reads it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, *step_ids: int) -> None:
        for step_id in step_ids:
            self._queue.put(Plan(step_id))

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self):
        return iter(self._queue.get, None)


def next_within_timeout(results, pool: ThreadPoolExecutor):
    return pool.submit(next, results).result(timeout=TIMEOUT_S)


def test_next_step_launched_before_the_previous_finishes_results_in_order():
    runner = FakeRunner(slow=True)
    results = list(pipeline(runner).run([Plan(i) for i in range(1, 6)]))
    assert results == [1, 2, 3, 4, 5]
    assert runner.calls == ["L1", "L2", "F1", "L3", "F2", "L4", "F3", "L5", "F4", "F5"]
    assert runner.max_unfinished == 2


# One launched step at most; or steps done as soon as launched, where a done step is finished
# before a queued plan is launched: the CPU backend's launch runs the whole forward, so launching
# step 2 first would hold step 1's result (a request's first token) back by step 2's forward.
@pytest.mark.parametrize("slow,max_launched", [(True, 1), (False, 2)],
                         ids=["one-launched", "done-steps"])
def test_steps_run_one_at_a_time(slow, max_launched):
    runner = FakeRunner(slow=slow)
    plans = [Plan(i) for i in range(1, 4)]
    assert list(pipeline(runner, max_launched).run(plans)) == [1, 2, 3]
    assert runner.calls == ["L1", "F1", "L2", "F2", "L3", "F3"]


def test_a_done_step_is_returned_without_waiting_for_the_next_plan():
    runner, plans = FakeRunner(slow=False), Plans()
    results = pipeline(runner).run(plans)
    with ThreadPoolExecutor(1) as pool:
        plans.send(1)
        assert next_within_timeout(results, pool) == 1  # plan 2 is not sent yet
        plans.send(2)
        assert next_within_timeout(results, pool) == 2
        plans.close()
        with pytest.raises(StopIteration):
            next_within_timeout(results, pool)


def test_a_step_that_completes_later_is_returned_without_waiting_for_the_next_plan():
    runner, plans = FakeRunner(slow=True), Plans()
    results = pipeline(runner).run(plans)
    with ThreadPoolExecutor(1) as pool:
        plans.send(1)
        result = pool.submit(next, results)
        pending = runner.launched.get(timeout=TIMEOUT_S)
        assert not result.done()  # step 1 still runs
        pending.done.set()  # the GPU finishes step 1 while no plan is queued
        assert result.result(timeout=TIMEOUT_S) == 1
        plans.send(2)
        result = pool.submit(next, results)
        runner.launched.get(timeout=TIMEOUT_S)
        plans.send(3)  # arrives while step 2 runs: launched before step 2 is finished
        assert result.result(timeout=TIMEOUT_S) == 2
        plans.close()
        assert next_within_timeout(results, pool) == 3
    assert runner.calls == ["L1", "F1", "L2", "L3", "F2", "F3"]


def test_a_rejected_plan_comes_after_the_result_of_the_step_before_it():
    runner = FakeRunner(slow=True, fail_launch=3)
    results = pipeline(runner).run([Plan(i) for i in range(1, 6)])
    assert [next(results), next(results)] == [1, 2]
    with pytest.raises(StepFailed) as failed:
        next(results)
    assert failed.value.step_id == 3 and isinstance(failed.value.cause, PlanMismatch)
    assert runner.calls == ["L1", "L2", "F1", "F2"]  # step 2 was unfinished when 3 was refused


def test_a_failed_finish_ends_the_results_at_that_step():
    runner = FakeRunner(slow=True, fail_finish=2)
    results = pipeline(runner).run([Plan(i) for i in range(1, 6)])
    assert next(results) == 1
    with pytest.raises(StepFailed) as failed:
        next(results)
    assert failed.value.step_id == 2 and isinstance(failed.value.cause, RuntimeError)


def test_a_broken_plan_stream_is_raised_as_is():
    def plans():
        yield Plan(1)
        raise ConnectionResetError("stream broke")

    with pytest.raises(ConnectionResetError):
        list(pipeline(FakeRunner(slow=False)).run(plans()))


def test_on_idle_runs_once_per_idle_spell_with_nothing_in_flight():
    """The executor logs its step timing when idle: once after each spell of work that no plan
    follows within idle_after_s, never while a step is in flight or plans keep coming."""
    runner, plans, idles = FakeRunner(slow=False), Plans(), queue.SimpleQueue()
    results = StepPipeline(runner.launch, runner.finish, idle_after_s=0.05,
                           on_idle=lambda: idles.put(len(runner.calls))).run(plans)
    with ThreadPoolExecutor(1) as pool:
        plans.send(1, 2)
        assert [next_within_timeout(results, pool) for _ in range(2)] == [1, 2]
        waiting = pool.submit(next, results)
        assert idles.get(timeout=TIMEOUT_S) == 4  # after L1 F1 L2 F2
        with pytest.raises(queue.Empty):
            idles.get(timeout=0.3)  # once, not every idle_after_s
        plans.send(3)
        assert waiting.result(timeout=TIMEOUT_S) == 3
        waiting = pool.submit(next, results)
        assert idles.get(timeout=TIMEOUT_S) == 6
        plans.close()
        with pytest.raises(StopIteration):
            waiting.result(timeout=TIMEOUT_S)
    assert idles.empty()


def test_on_idle_is_not_called_while_a_step_runs():
    runner, plans, idles = FakeRunner(slow=True), Plans(), []
    results = StepPipeline(runner.launch, runner.finish, on_idle=lambda: idles.append(1),
                           idle_after_s=0.01).run(plans)
    with ThreadPoolExecutor(1) as pool:
        plans.send(1)
        result = pool.submit(next, results)
        pending = runner.launched.get(timeout=TIMEOUT_S)
        threading.Event().wait(0.2)  # step 1 runs, no plan comes: not idle
        assert idles == [] and not result.done()
        pending.done.set()
        assert result.result(timeout=TIMEOUT_S) == 1
        plans.close()
        with pytest.raises(StopIteration):
            next_within_timeout(results, pool)
