"""What the scheduler tells its operator: the periodic stats line (only for intervals in which a
step ran), a debug line per request with its id, and preemptions and swapped pages as counters
that survive a fresh scheduler."""
import asyncio
import dataclasses
import logging

import pytest

from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.metrics import Metrics, StatsLog
from scheduler_svc.scheduler_stats import SchedulerStats
from test_engine import SPECS, FakeClient, run, serve

STATUS = SchedulerStats(running=3, waiting=2, swapped=1, gpu_blocks_used=16, gpu_blocks_total=64,
                        cpu_blocks_used=0, cpu_blocks_total=32)


def test_the_stats_line_reports_the_interval_and_is_silent_when_nothing_ran():
    stats = StatsLog(now=100.0)
    assert stats.line(110.0, STATUS) is None
    stats.on_step(num_scheduled_tokens=40, num_sampled=2)  # 38 prompt tokens, 2 sampled
    stats.on_step(num_scheduled_tokens=2, num_sampled=2)  # decodes only
    line = stats.line(112.0, STATUS)
    assert line == ("stats: 3 running, 2 waiting, 1 swapped; KV pages 16/64 (25.0%), swap pages "
                    "0/32 (0.0%); prompt 19.0 tokens/s, generation 2.0 tokens/s; 2 steps in 2.0s")
    assert stats.line(113.0, STATUS) is None  # counts start again with each line


def test_the_engine_logs_stats_while_serving_and_each_request_at_debug(caplog):
    specs = [dataclasses.replace(s, request_id=f"req-{i}") for i, s in enumerate(SPECS)]

    async def until_a_stats_line(engine):
        while not any(r.getMessage().startswith("stats: ") for r in caplog.records):
            await asyncio.sleep(0.01)

    # the stats line is the engine's, each request's end the output side's
    with caplog.at_level(logging.DEBUG, logger="scheduler_svc"):
        run(serve(FakeClient(), specs, EngineConfig(log_stats_interval_s=0.05),
                  during=until_a_stats_line))
    stats = next(r for r in caplog.records if r.getMessage().startswith("stats: "))
    assert stats.levelno == logging.INFO and "tokens/s" in stats.getMessage()
    finished = [r for r in caplog.records if " finished (length): " in r.getMessage()]
    assert {r.getMessage().split()[1] for r in finished} == {s.request_id for s in specs}
    assert {r.levelno for r in finished} == {logging.DEBUG}


def stats(swap=0, recompute=0, out=0, into=0):
    return SchedulerStats(gpu_blocks_total=8, cpu_blocks_total=4, num_preemptions_swap=swap,
                          num_preemptions_recompute=recompute, num_blocks_swapped_out=out,
                          num_blocks_swapped_in=into)


def test_preemptions_and_swapped_pages_are_counters_across_schedulers():
    metrics = Metrics()
    metrics.on_new_scheduler()
    metrics.observe_scheduler(stats())
    metrics.observe_scheduler(stats(swap=2, out=6))
    metrics.observe_scheduler(stats(swap=2, out=6))  # nothing new
    metrics.on_new_scheduler()  # a fresh scheduler counts from zero again
    metrics.observe_scheduler(stats(swap=1, recompute=1, out=3, into=3))
    value = metrics.registry.get_sample_value
    assert value("pagedserve_preemptions_total", {"mode": "swap"}) == 3
    assert value("pagedserve_preemptions_total", {"mode": "recompute"}) == 1
    assert value("pagedserve_blocks_swapped_total", {"direction": "out"}) == 9
    assert value("pagedserve_blocks_swapped_total", {"direction": "in"}) == 3
    kinds = {m.name: m.type for m in metrics.registry.collect()}
    assert kinds["pagedserve_preemptions"] == kinds["pagedserve_blocks_swapped"] == "counter"


def test_the_executors_step_times_are_histograms_by_step_kind():
    """FakeClient answers every step with forward_ms=2 and step_ms=3; 12 prompts of 5-11 tokens
    and 12 tokens each make prefill steps first, then steps of decodes only."""
    _, engine, _ = run(serve(FakeClient(), SPECS))
    value = engine.metrics.registry.get_sample_value
    steps = {kind: value("pagedserve_executor_step_seconds_count", {"kind": kind})
             for kind in ("prefill", "decode")}
    assert steps["prefill"] >= 1 and steps["decode"] >= 11
    assert steps["prefill"] + steps["decode"] <= engine.num_steps  # drop-only plans not counted
    for kind, count in steps.items():
        assert value("pagedserve_executor_step_seconds_sum", {"kind": kind}) == \
            pytest.approx(0.003 * count)
        assert value("pagedserve_executor_forward_seconds_sum", {"kind": kind}) == \
            pytest.approx(0.002 * count)


def test_prefix_cache_counters_gauges_and_stats_line():
    """Issue 12's list: the hit rate in tokens (queries and hits, counters), the pages cached (a
    gauge, per device) and the pages copied on write (a counter); and the swapped pages that
    were shared rather than copied."""
    metrics = Metrics()
    metrics.on_new_scheduler()
    q = SchedulerStats(gpu_blocks_total=8, gpu_blocks_cached=3, cpu_blocks_cached=2,
                       num_prefix_cache_queries=40, num_prefix_cache_hits=10, num_blocks_copied=2,
                       num_blocks_swapped_out=5, num_blocks_swap_shared_out=4,
                       num_blocks_swap_shared_in=6)
    metrics.observe_scheduler(q)
    metrics.observe_scheduler(q)  # nothing new
    value = metrics.registry.get_sample_value
    assert value("pagedserve_prefix_cache_queries_total") == 40
    assert value("pagedserve_prefix_cache_hits_total") == 10
    assert value("pagedserve_gpu_blocks_cached") == 3
    assert value("pagedserve_cpu_blocks_cached") == 2
    assert value("pagedserve_blocks_copied_total") == 2
    assert value("pagedserve_blocks_swapped_total", {"direction": "out"}) == 5
    assert value("pagedserve_blocks_swap_shared_total", {"direction": "out"}) == 4
    assert value("pagedserve_blocks_swap_shared_total", {"direction": "in"}) == 6
    kinds = {m.name: m.type for m in metrics.registry.collect()}
    assert {kinds[f"pagedserve_{name}"] for name in (
        "prefix_cache_queries", "prefix_cache_hits", "blocks_copied", "blocks_swap_shared")} == \
        {"counter"}
    assert kinds["pagedserve_gpu_blocks_cached"] == kinds["pagedserve_cpu_blocks_cached"] == "gauge"
    log = StatsLog(now=0.0)
    log.on_step(num_scheduled_tokens=4, num_sampled=4)
    assert log.line(1.0, q).endswith("; prefix cache hit rate 25.0%, 3 pages cached")
