"""The scheduler's metrics also under vLLM's names (`vllm:*`, labelled `model_name`) where the
meaning is the same, for the Gateway API Inference Extension's endpoint picker and vLLM
dashboards: a collector over the pagedserve_* metrics, read at scrape time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)

from scheduler_svc.metrics import Metrics

# pagedserve's finish reasons -> vLLM's finished_reason label
_FINISHED_REASONS = {"eos": "stop", "stop_token": "stop", "stop_string": "stop",
                     "length": "length", "aborted": "abort", "cancelled": "abort"}


class VllmCollector:
    """Register with `registry.register(VllmCollector(metrics, model_name))`; `model_name()` is
    the served model name ("" while none is known)."""

    def __init__(self, metrics: Metrics, model_name: Callable[[], str]) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def describe(self) -> list:
        return []  # collected only at scrape time: the registry must not call collect() early

    def collect(self) -> Iterator:
        m, label = self.metrics, [self.model_name()]
        yield _gauge("vllm:num_requests_running", "Requests running (on the GPU).", label,
                     _value(m.requests_running))
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", label,
                     _value(m.requests_waiting))
        yield _gauge("vllm:num_requests_swapped", "Requests swapped out to the CPU.", label,
                     _value(m.requests_swapped))
        kv_usage = _share(_value(m.gpu_blocks_used), _value(m.gpu_blocks_total))
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", label,
                     kv_usage)
        # the name vLLM used before kv_cache_usage_perc; older endpoint pickers read it
        yield _gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage; 1 means 100 percent.",
                     label, kv_usage)
        swap_usage = _share(_value(m.cpu_blocks_used), _value(m.cpu_blocks_total))
        yield _gauge("vllm:cpu_cache_usage_perc", "CPU (swap) KV-cache usage; 1 means 100 "
                     "percent.", label, swap_usage)
        yield _counter("vllm:prompt_tokens", "Prompt tokens admitted.", label,
                       _value(m.prompt_tokens))
        yield _counter("vllm:generation_tokens", "Tokens generated.", label,
                       _value(m.generated_tokens))
        yield _counter("vllm:num_preemptions", "Preemptions (swap and recompute).", label,
                       sum(_values(m.preemptions).values()))
        # vLLM v1's prefix cache counters, in tokens as ours: queried, and found cached
        yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                       "queried tokens.", label, _value(m.prefix_cache_queries))
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                       "cached tokens.", label, _value(m.prefix_cache_hits))
        yield self._request_success(label)
        yield _histogram("vllm:time_to_first_token_seconds", "Time to first token.", label, m.ttft)
        yield _histogram("vllm:inter_token_latency_seconds", "Time between tokens.", label, m.itl)
        yield _histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end.", label,
                         m.e2e)

    def _request_success(self, label: list[str]) -> CounterMetricFamily:
        family = CounterMetricFamily("vllm:request_success", "Requests finished, by reason.",
                                     labels=["model_name", "finished_reason"])
        totals: dict[str, float] = {}
        for labels, value in _values(self.metrics.requests_finished).items():
            reason = _FINISHED_REASONS.get(dict(labels).get("reason", ""), "abort")
            totals[reason] = totals.get(reason, 0.0) + value
        for reason, value in totals.items():
            family.add_metric([*label, reason], value)
        return family


def _values(metric) -> dict[tuple, float]:
    """{labels: value} of a gauge or counter (its _created samples left out)."""
    return {tuple(sorted(s.labels.items())): s.value
            for family in metric.collect() for s in family.samples
            if not s.name.endswith("_created")}


def _value(metric) -> float:
    return sum(_values(metric).values())


def _share(used: float, total: float) -> float:
    return used / total if total else 0.0


def _gauge(name: str, doc: str, label: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(label, value)
    return family


def _counter(name: str, doc: str, label: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(label, value)
    return family


def _histogram(name: str, doc: str, label: list[str], source) -> HistogramMetricFamily:
    buckets, total = [], 0.0
    for family in source.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append((s.labels["le"], s.value))
            elif s.name.endswith("_sum"):
                total = s.value
    out = HistogramMetricFamily(name, doc, labels=["model_name"])
    out.add_metric(label, buckets, total)
    return out
