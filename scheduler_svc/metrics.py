"""Prometheus metrics of the scheduler service, refreshed from the engine once per step, and the
periodic stats line of its log.
"""
from __future__ import annotations

import bisect
import os
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from scheduler_svc.scheduler_stats import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class BatchHistogram:
    """A Prometheus histogram fed many observations at once: one lock per batch, not per value.
    Exported as prometheus_client's Histogram exports one (buckets by `le`, count, sum)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = [float(b) for b in buckets] + [float("inf")]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # the scrape runs in the metrics server's thread
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values) -> None:
        """Each value counts in the first bucket whose bound is >= it, as Histogram.observe."""
        if not values:
            return
        counts = [0] * len(self._bounds)
        for value in values:
            counts[bisect.bisect_left(self._bounds, value)] += 1
        total = sum(values)
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts)]
            self._sum += total

    def collect(self):
        with self._lock:
            counts, total = self._counts, self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets,
                                    sum_value=total)


class Metrics:
    """Owns its own registry, so tests can run several engines in one process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_running = Gauge("pagedserve_requests_running", "sequences running", registry=r)
        self.requests_waiting = Gauge("pagedserve_requests_waiting", "sequences waiting", registry=r)
        self.requests_swapped = Gauge("pagedserve_requests_swapped", "sequences swapped out", registry=r)
        self.gpu_blocks_used = Gauge("pagedserve_gpu_blocks_used", "GPU KV pages in use", registry=r)
        self.gpu_blocks_total = Gauge("pagedserve_gpu_blocks_total", "GPU KV pages", registry=r)
        self.cpu_blocks_used = Gauge("pagedserve_cpu_blocks_used", "CPU swap pages in use", registry=r)
        self.cpu_blocks_total = Gauge("pagedserve_cpu_blocks_total", "CPU swap pages", registry=r)
        # Counters, exported as *_total; the scheduler keeps running counts that observe_scheduler
        # turns into increments (a fresh scheduler, after a step-loop restart, counts from zero:
        # the engine says so with on_new_scheduler).
        self.preemptions = Counter("pagedserve_preemptions", "preemptions, by mode", ["mode"],
                                   registry=r)
        self.blocks_swapped = Counter("pagedserve_blocks_swapped", "pages copied by swaps, by "
                                      "direction", ["direction"], registry=r)
        self.blocks_swap_shared = Counter(
            "pagedserve_blocks_swap_shared", "pages a swap found on the other device already "
            "(another seq's, or cached), shared there instead of copied, by direction",
            ["direction"], registry=r)
        self._counted: dict[object, int] = {}  # labelled counter -> the count it has seen
        # Prefix caching (vLLM's prefix_cache_queries/hits): tokens of the sequences admitted
        # from scratch, and how many of them were found cached; pages in the cache; copies.
        self.prefix_cache_queries = Counter(
            "pagedserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
            registry=r)
        self.prefix_cache_hits = Counter(
            "pagedserve_prefix_cache_hits", "prompt tokens found in the prefix cache", registry=r)
        self.gpu_blocks_cached = Gauge("pagedserve_gpu_blocks_cached",
                                       "GPU KV pages in the prefix cache (in use or free)",
                                       registry=r)
        self.cpu_blocks_cached = Gauge("pagedserve_cpu_blocks_cached",
                                       "CPU swap pages holding a cached page (in use or free)",
                                       registry=r)
        self.blocks_copied = Counter("pagedserve_blocks_copied",
                                     "GPU pages copied (parallel sampling's copy-on-write)", registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("pagedserve_generated_tokens", "tokens generated", registry=r)
        self.requests_finished = Counter("pagedserve_requests_finished", "requests finished, by reason",
                                         ["reason"], registry=r)
        self.executor_reconnects = Counter("pagedserve_executor_resyncs",
                                           "times the executor was lost and state rebuilt", registry=r)
        self.steps = Counter("pagedserve_steps", "steps executed", registry=r)
        # Observed once per step for all its tokens (a step of 1,000 sequences would otherwise
        # take 1,000 locked updates on the step loop).
        self.ttft = BatchHistogram("pagedserve_time_to_first_token_seconds",
                                   "time to first token", _LATENCY_BUCKETS, r)
        self.itl = BatchHistogram("pagedserve_inter_token_latency_seconds", "time between tokens",
                                  _LATENCY_BUCKETS, r)
        self.e2e = Histogram("pagedserve_request_latency_seconds", "request latency, end to end",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # What each step's result says the executor spent on it, by kind: "decode" when every
        # scheduled sequence computes one token (CUDA graph replays on a GPU), else "prefill".
        self.executor_step = Histogram(
            "pagedserve_executor_step_seconds", "executor host time per step, launch and finish "
            "(GPU wait included), by kind", ["kind"], buckets=_STEP_BUCKETS, registry=r)
        self.executor_forward = Histogram(
            "pagedserve_executor_forward_seconds", "executor host time building and queueing a "
            "step's forward pass and sampling, by kind", ["kind"], buckets=_STEP_BUCKETS,
            registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Starts the /metrics HTTP endpoint in a daemon thread; RuntimeError "cannot listen on
        ..." if it cannot bind, as the other listeners."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise RuntimeError(f"cannot listen on {host}:{port} (in use, or not an address "
                               f"here): {os.strerror(err.errno) if err.errno else err}") from err

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        """Copies the scheduler's gauges and counters (Scheduler.stats()); called once per step."""
        self.requests_running.set(stats.running)
        self.requests_waiting.set(stats.waiting)
        self.requests_swapped.set(stats.swapped)
        self.gpu_blocks_total.set(stats.gpu_blocks_total)
        self.gpu_blocks_used.set(stats.gpu_blocks_used)
        self.cpu_blocks_total.set(stats.cpu_blocks_total)
        self.cpu_blocks_used.set(stats.cpu_blocks_used)
        self._advance(self.preemptions, "swap", stats.num_preemptions_swap)
        self._advance(self.preemptions, "recompute", stats.num_preemptions_recompute)
        self._advance(self.blocks_swapped, "out", stats.num_blocks_swapped_out)
        self._advance(self.blocks_swapped, "in", stats.num_blocks_swapped_in)
        self._advance(self.blocks_swap_shared, "out", stats.num_blocks_swap_shared_out)
        self._advance(self.blocks_swap_shared, "in", stats.num_blocks_swap_shared_in)
        self.gpu_blocks_cached.set(stats.gpu_blocks_cached)
        self.cpu_blocks_cached.set(stats.cpu_blocks_cached)
        self._advance(self.prefix_cache_queries, None, stats.num_prefix_cache_queries)
        self._advance(self.prefix_cache_hits, None, stats.num_prefix_cache_hits)
        self._advance(self.blocks_copied, None, stats.num_blocks_copied)

    def observe_executor_step(self, kind: str, forward_ms: float, step_ms: float) -> None:
        self.executor_forward.labels(kind).observe(forward_ms / 1e3)
        self.executor_step.labels(kind).observe(step_ms / 1e3)

    def on_new_scheduler(self) -> None:
        """The engine made a fresh scheduler: its running counts start again from zero."""
        self._counted = {}

    def _advance(self, counter: Counter, label: str | None, count: int) -> None:
        """Adds what the scheduler's running `count` gained since it was last observed (label
        None: an unlabelled counter)."""
        child = counter if label is None else counter.labels(label)
        seen = self._counted.get(child, 0)
        if count > seen:
            child.inc(count - seen)
        self._counted[child] = count


class StatsLog:
    """The periodic stats line (as vLLM's): sequences running, waiting and swapped, KV pages in
    use, and prompt and generation throughput since the previous line. Prompt tokens are the
    scheduled tokens that sampled nothing (prefill chunks, recomputes); generation tokens are the
    sampled ones. No line for an interval in which no step ran."""

    def __init__(self, now: float) -> None:
        self._since = now
        self._num_steps = self._num_prompt_tokens = self._num_generated_tokens = 0

    def on_step(self, num_scheduled_tokens: int, num_sampled: int) -> None:
        self._num_steps += 1
        self._num_prompt_tokens += num_scheduled_tokens - num_sampled
        self._num_generated_tokens += num_sampled

    def line(self, now: float, scheduler: SchedulerStats) -> str | None:
        """The line for the interval that ends `now` (the next one starts), or None if no step
        ran in it; `scheduler` is the scheduler's snapshot."""
        elapsed, self._since = max(now - self._since, 1e-9), now
        steps, prompt, generated = (self._num_steps, self._num_prompt_tokens,
                                    self._num_generated_tokens)
        self._num_steps = self._num_prompt_tokens = self._num_generated_tokens = 0
        if not steps:
            return None
        q = scheduler
        return (f"stats: {q.running} running, {q.waiting} waiting, {q.swapped} swapped; "
                f"KV pages {_share(q.gpu_blocks_used, q.gpu_blocks_total)}, "
                f"swap pages {_share(q.cpu_blocks_used, q.cpu_blocks_total)}; "
                f"prompt {prompt / elapsed:.1f} tokens/s, generation {generated / elapsed:.1f} "
                f"tokens/s; {steps} steps in {elapsed:.1f}s{_prefix_cache(q)}")


def _prefix_cache(q: SchedulerStats) -> str:
    """The prefix cache's hit rate since the scheduler started, once it was asked anything."""
    if not q.num_prefix_cache_queries:
        return ""
    rate = 100.0 * q.num_prefix_cache_hits / q.num_prefix_cache_queries
    return f"; prefix cache hit rate {rate:.1f}%, {q.gpu_blocks_cached} pages cached"


def _share(used: int, total: int) -> str:
    percent = 100.0 * used / total if total else 0.0
    return f"{used}/{total} ({percent:.1f}%)"
