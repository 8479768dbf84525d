"""BatchHistogram (the latency histograms, fed once per step) exports what prometheus_client's
Histogram exports for the same observations."""
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scheduler_svc.metrics import _LATENCY_BUCKETS, BatchHistogram


def test_same_exposition_as_a_histogram_observed_value_by_value():
    rng = random.Random(0)
    # bounds themselves, zero, past the last bound, and a spread in between
    values = [rng.choice([0.0, 0.005, 0.25, 1, 120, 500]) if rng.random() < 0.3
              else rng.expovariate(3) for _ in range(2000)]
    reference, batched = CollectorRegistry(), CollectorRegistry()
    one_by_one = Histogram("lat_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=reference)
    for value in values:
        one_by_one.observe(value)
    histogram = BatchHistogram("lat_seconds", "doc", _LATENCY_BUCKETS, batched)
    histogram.observe_many(values[:1500])
    histogram.observe_many([])
    for value in values[1500:]:
        histogram.observe(value)
    want = [line for line in generate_latest(reference).decode().splitlines()
            if "_created" not in line]
    assert generate_latest(batched).decode().splitlines() == want
