"""The scheduler's metrics under vLLM's names read the same measurements as pagedserve_*."""
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.metrics import Metrics
from scheduler_svc.scheduler_stats import SchedulerStats
from scheduler_svc.vllm_metrics import VllmCollector


def samples(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:")}


def test_vllm_names_mirror_the_pagedserve_metrics():
    metrics = Metrics()
    metrics.registry.register(VllmCollector(metrics, lambda: "m"))
    metrics.observe_scheduler(SchedulerStats(
        running=3, waiting=2, swapped=1, gpu_blocks_used=25, gpu_blocks_total=100,
        cpu_blocks_used=0, cpu_blocks_total=50, num_preemptions_swap=2,
        num_preemptions_recompute=1, num_prefix_cache_queries=120, num_prefix_cache_hits=48))
    metrics.prompt_tokens.inc(40)
    metrics.generated_tokens.inc(7)
    for reason in ("eos", "stop_string", "length", "cancelled"):
        metrics.requests_finished.labels(reason).inc()
    metrics.ttft.observe(0.2)
    got = samples(metrics)
    model = [("model_name", "m")]
    assert got[f"vllm:num_requests_running{model}"] == 3
    assert got[f"vllm:num_requests_waiting{model}"] == 2
    assert got[f"vllm:kv_cache_usage_perc{model}"] == 0.25
    assert got[f"vllm:prompt_tokens_total{model}"] == 40
    assert got[f"vllm:generation_tokens_total{model}"] == 7
    assert got[f"vllm:num_preemptions_total{model}"] == 3
    success = {reason: got[f"vllm:request_success_total{sorted([('finished_reason', reason), *model])}"]
               for reason in ("stop", "length", "abort")}
    assert success == {"stop": 2, "length": 1, "abort": 1}
    assert got[f"vllm:time_to_first_token_seconds_count{model}"] == 1
    assert got[f"vllm:time_to_first_token_seconds_bucket{sorted([('le', '0.25'), *model])}"] == 1
    assert got[f"vllm:time_to_first_token_seconds_bucket{sorted([('le', '0.1'), *model])}"] == 0
    # vLLM v1's prefix cache counters, in tokens, the same counts as pagedserve_prefix_cache_*
    assert got[f"vllm:prefix_cache_queries_total{model}"] == 120
    assert got[f"vllm:prefix_cache_hits_total{model}"] == 48
    value = metrics.registry.get_sample_value
    assert value("pagedserve_prefix_cache_queries_total") == 120
    assert value("pagedserve_prefix_cache_hits_total") == 48
    types = {f.name: f.type for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    assert types["vllm:prefix_cache_queries"] == types["vllm:prefix_cache_hits"] == "counter"
