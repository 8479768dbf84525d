"""StepTimer's arithmetic on fake CUDA events (GPU-clock timestamps set by the test): the gap is
the GPU's idle time between the previous step's end and this step's start, whichever way the
steps were launched."""
import logging

import pytest
import torch

from executor_svc.step_timing import StepTimer


class FakeEvent:
    """A CUDA event whose GPU timestamp is the test's `now` when recorded."""

    now = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        self.t = FakeEvent.now

    def synchronize(self) -> None:
        assert self.t is not None

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.t - self.t


@pytest.fixture
def timer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return StepTimer(torch.device("cuda"), log_every=3)


def step(timer, start: float, end: float, kind: str = "decode", host_ms: float = 1.0,
         launch_ms: float = 0.5):
    FakeEvent.now = start
    marks = timer.begin()
    FakeEvent.now = end
    timer.end_gpu(marks)
    return marks, kind, host_ms, launch_ms


def test_gap_is_gpu_idle_between_steps(timer, caplog):
    first = step(timer, 0.0, 10.0)
    second = step(timer, 10.0, 24.0)  # launched before the first ended: starts as it ends
    third = step(timer, 25.5, 39.5)  # launched 1.5 ms after the second ended
    for marks in (first, second, third):
        timer.finish(*marks)
    t = timer.totals["decode"]
    assert t.steps == 2  # the first step has no previous end
    assert (t.gap_ms, t.wall_ms, t.gpu_ms, t.step_ms, t.launch_ms) == (1.5, 29.5, 28.0, 2.0, 1.0)
    with caplog.at_level(logging.INFO):
        timer.finish(*step(timer, 40.0, 50.0, kind="other"))  # the 3rd counted step: a report
    assert "gap_ms=0.750" in caplog.text and "gpu_wait_frac=0.051" in caplog.text
    timer.reset()
    timer.finish(*step(timer, 60.0, 70.0))
    assert timer.totals["decode"].steps == 0  # no previous end after a reset


def test_allocator_line_reads_the_counts_that_can_sync_a_launch():
    from executor_svc.step_timing import allocator_line

    stats = {"num_alloc_retries": 3, "num_device_alloc": 40, "num_device_free": 7, "other": 1}
    assert allocator_line(stats) == "alloc_retries=3 device_allocs=40 device_frees=7"
    assert allocator_line({}) == "alloc_retries=0 device_allocs=0 device_frees=0"


def test_bench_serving_reads_the_allocator_line():
    from benchmarks.bench_serving import _step_timing

    log = ("INFO step timing decode: steps=3 wall_ms=1.000 gap_ms=0.1\n"
           "INFO step timing allocator: alloc_retries=2 device_allocs=9 device_frees=1\n")
    timing = _step_timing(log)
    assert timing["allocator"] == {"alloc_retries": 2.0, "device_allocs": 9.0, "device_frees": 1.0}
    assert timing["decode"]["steps"] == 3.0


def test_bench_serving_prints_the_other_steps_and_the_allocator():
    from benchmarks.bench_serving import _fmt

    serving = dict(complete=2, requests=2, timed_out=False, output_tokens=8,
                   expected_output_tokens=8, wall_s=1.0, output_tok_s=8.0, ttft_p50_s=0.1,
                   ttft_p99_s=0.2, itl_p50_ms=5.0, itl_p99_ms=9.0, peak_gpu_blocks=3,
                   gpu_blocks_total=10, prefix_cache_hit_rate=0.0, prefix_cache_hits=0,
                   prefix_cache_queries=8, preemptions_swap=0, preemptions_recompute=0,
                   blocks_swapped_out=0, blocks_swapped_in=0, executor_step_timing={
                       "decode": {"steps": 4.0, "wall_ms": 2.0},
                       "other": {"steps": 1.0, "wall_ms": 9.0, "launch_ms": 7.5},
                       "allocator": {"alloc_retries": 2.0, "device_allocs": 9.0,
                                     "device_frees": 1.0}})
    text = _fmt(serving, None)
    assert "other steps (executor) 1: wall 9.00 ms, gap 0.00 ms, launch 7.50 ms" in text
    assert "allocator              2 retries, 9 device allocations, 1 frees" in text
