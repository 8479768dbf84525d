"""The waiting queue's drain rate on a fake clock: measured only while sequences wait and an
executor runs them, trusted only after MIN_OBSERVED_S; the scheduler counts every sample of a
request as a waiting sequence and measures its starts."""
import random

import pytest

from scheduler_svc.admission import retry_hint_s
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.drain_rate import MIN_OBSERVED_S, DrainRate
from scheduler_svc.scheduler import Scheduler
from sched_factories import Loop, make_samples, make_seq


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_rate_until_the_backlog_was_watched_long_enough():
    drain = DrainRate()
    drain.observe(0.0, 0, 10)
    drain.observe(MIN_OBSERVED_S - 0.5, 3, 7)
    assert drain.rate() is None
    drain.observe(MIN_OBSERVED_S + 0.5, 2, 5)
    assert drain.rate() == pytest.approx((5 + 1) / (MIN_OBSERVED_S + 0.5), rel=0.1)


def test_time_without_a_backlog_or_an_executor_is_not_counted():
    drain = DrainRate()
    drain.observe(0.0, 0, 0)
    drain.observe(100.0, 50, 0)  # nothing waited before these starts: an idle server
    assert drain.rate() is None
    drain.observe(101.0, 0, 4)
    drain.pause()  # the executor is lost: nothing can start
    drain.observe(160.0, 0, 4)
    assert drain.rate() is None
    for t in range(161, 171):
        drain.observe(float(t), 2, 4)
    assert drain.rate() == pytest.approx(21 / 10, rel=0.1)


def test_a_stuck_queue_reads_as_slow_not_as_stopped():
    drain = DrainRate()
    for t in range(0, 31):
        drain.observe(float(t), 0, 100)
    rate = drain.rate()
    assert rate is not None and 0 < rate < 0.05


def test_old_observations_fade():
    drain = DrainRate(horizon_s=10.0)
    for t in range(0, 20):
        drain.observe(float(t), 10, 100)  # 10 starts/s
    for t in range(20, 80):
        drain.observe(float(t), 1, 100)  # then 1/s
    assert drain.rate() == pytest.approx(1.0, rel=0.15)  # +1 start assumed: 11 in 10 s


@pytest.mark.parametrize("seconds, hint", [(None, 1), (0.2, 1), (7.1, 8), (1e9, 60),
                                           (float("inf"), 60)])
def test_retry_hints_are_whole_seconds_within_what_clients_honour(seconds, hint):
    assert retry_hint_s(seconds) == hint


def make(clock: Clock, max_num_seqs: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs)
    return Scheduler(config, BlockManager(4, 256, 64, cache_salt="t"), rng=random.Random(0),
                     clock=clock)


def test_the_samples_of_a_request_count_as_waiting_sequences():
    sched = make(Clock(), max_num_seqs=1)
    first = make_seq(1, prompt_len=8, max_tokens=4)
    sched.add_seq(first, make_samples(first, 16, 2))
    assert sched.num_waiting == 16 == sched.stats().waiting
    Loop(sched).step()  # the first sample runs; the others wait for room to fork
    assert sched.num_waiting == 15


def test_the_scheduler_measures_how_fast_waiting_sequences_start():
    clock = Clock()
    sched = make(clock, max_num_seqs=2)
    for seq_id in range(1, 41):
        sched.add_seq(make_seq(seq_id, prompt_len=4, max_tokens=4))
    loop = Loop(sched)
    started = 0
    for _ in range(40):  # one step a second: two seqs finish (and two start) every 4 steps
        clock.now += 1.0
        waiting = sched.num_waiting
        loop.step()
        started += waiting - sched.num_waiting
    assert sched.drain_rate() == pytest.approx(0.5, rel=0.15), started
    sched.reset_executor()  # the outage until the next step is not a slow queue
    clock.now += 600
    loop.executor.reset()
    loop.step()
    assert sched.drain_rate() == pytest.approx(0.5, rel=0.15)
