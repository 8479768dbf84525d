"""Prometheus metrics of the scheduler service, refreshed from the engine once per step.

Each Metrics instance owns its own registry, so tests can run several engines in one process.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_running = Gauge("pagedserve_requests_running", "sequences running", registry=r)
        self.requests_waiting = Gauge("pagedserve_requests_waiting", "sequences waiting", registry=r)
        self.requests_swapped = Gauge("pagedserve_requests_swapped", "sequences swapped out", registry=r)
        self.gpu_blocks_used = Gauge("pagedserve_gpu_blocks_used", "GPU KV pages in use", registry=r)
        self.gpu_blocks_total = Gauge("pagedserve_gpu_blocks_total", "GPU KV pages", registry=r)
        self.cpu_blocks_used = Gauge("pagedserve_cpu_blocks_used", "CPU swap pages in use", registry=r)
        self.cpu_blocks_total = Gauge("pagedserve_cpu_blocks_total", "CPU swap pages", registry=r)
        self.preemptions = Gauge("pagedserve_preemptions", "preemptions so far, by mode",
                                 ["mode"], registry=r)
        self.blocks_swapped = Gauge("pagedserve_blocks_swapped", "pages swapped so far, by direction",
                                    ["direction"], registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("pagedserve_generated_tokens", "tokens generated", registry=r)
        self.requests_finished = Counter("pagedserve_requests_finished", "requests finished, by reason",
                                         ["reason"], registry=r)
        self.executor_reconnects = Counter("pagedserve_executor_resyncs",
                                           "times the executor was lost and state rebuilt", registry=r)
        self.steps = Counter("pagedserve_steps", "steps executed", registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedserve_inter_token_latency_seconds", "time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_request_latency_seconds", "request latency, end to end",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Starts the /metrics HTTP endpoint in a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)

    def observe_scheduler(self, scheduler) -> None:
        """Copies the scheduler's gauges and counters; called once per step."""
        bm = scheduler.block_manager
        self.requests_running.set(scheduler.num_running)
        self.requests_waiting.set(scheduler.num_waiting)
        self.requests_swapped.set(scheduler.num_swapped)
        self.gpu_blocks_total.set(bm.num_gpu_blocks)
        self.gpu_blocks_used.set(bm.num_gpu_blocks - bm.num_free_gpu_blocks)
        self.cpu_blocks_total.set(bm.num_cpu_blocks)
        self.cpu_blocks_used.set(bm.num_cpu_blocks - bm.num_free_cpu_blocks)
        self.preemptions.labels("swap").set(scheduler.num_preemptions_swap)
        self.preemptions.labels("recompute").set(scheduler.num_preemptions_recompute)
        self.blocks_swapped.labels("out").set(scheduler.num_blocks_swapped_out)
        self.blocks_swapped.labels("in").set(scheduler.num_blocks_swapped_in)
