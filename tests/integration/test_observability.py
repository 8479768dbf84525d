"""What an operator of real processes sees: the scheduler's line while it waits for an executor
and its periodic stats line while it serves, preemptions and swapped pages as Prometheus
counters, the executor's loading lines and its KV pages named by device, and server reflection as
current grpcurl asks for it (v1) on both services."""
from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest

from tests.integration.harness import generate, start_services, wait_started
from tests.test_reflection import v1_services

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """The scheduler first, alone until it said what it waits for; then its executor."""
    s = start_services(tmp_path_factory.mktemp("observability"), None,
                       ["--log-stats-interval", "0.2"], wait=False)
    try:
        wait_for_line(s, "scheduler", "still no executor attached after ")
        s.add_executor("executor", ["--model", "preset:tiny"],
                       port=int(s.executor_address.rsplit(":", 1)[1]), wait=False)
        wait_started(s)
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


def wait_for_line(services, name: str, text: str, timeout_s: float = 30.0) -> str:
    """The first line of `name`'s log that contains `text` (a log line cannot be awaited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in services.log_of(name).splitlines() if text in line]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in the {name} log:\n{services.log_of(name)[-3000:]}")


def test_the_scheduler_says_what_it_waits_for(services):
    log = services.log_of("scheduler")
    waiting = re.search(r"INFO scheduler_svc: still no executor attached after 0\.2[0-9]*s: "
                        f"waiting for an executor at {re.escape(services.executor_address)}\n",
                        log).start()
    attached = log.index(f"attached executor {services.executor_address} ")
    assert waiting < attached
    line = log[attached:log.index("\n", attached)]
    assert "KV pages (cpu)" in line and "GPU" not in line  # the cpu backend has no GPU blocks


def test_the_stats_line_appears_while_serving(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        generate(services.stub(channel), [5, 6, 7], max_tokens=8)
    line = wait_for_line(services, "scheduler", "scheduler_svc.engine: stats: ")
    assert "INFO" in line and "KV pages" in line and "generation" in line and "tokens/s" in line
    assert " finished (length)" not in services.log_of("scheduler")  # request lines: DEBUG


def test_preemptions_and_swapped_pages_are_counters(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        generate(services.stub(channel), [5, 6, 7], max_tokens=2)
    samples = services.metrics()
    for mode in ("swap", "recompute"):
        assert f'pagedserve_preemptions_total{{mode="{mode}"}}' in samples
    for direction in ("out", "in"):
        assert f'pagedserve_blocks_swapped_total{{direction="{direction}"}}' in samples
    url = f"http://127.0.0.1:{services.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert "# TYPE pagedserve_preemptions_total counter" in text
    assert "# TYPE pagedserve_blocks_swapped_total counter" in text


def test_the_executors_step_times_are_histograms_by_kind(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        generate(services.stub(channel), [5, 6, 7], max_tokens=4)  # a prefill, then decodes
    samples = services.metrics()
    for kind in ("prefill", "decode"):
        for name in ("step", "forward"):
            assert samples[f'pagedserve_executor_{name}_seconds_count{{kind="{kind}"}}'] >= 1
            assert samples[f'pagedserve_executor_{name}_seconds_sum{{kind="{kind}"}}'] > 0


def test_the_executor_names_its_kv_pages_by_device(services):
    line = wait_for_line(services, "executor", "executor ready on")
    assert "KV pages (cpu, float32)" in line and "GPU" not in line
    assert "GPU blocks" not in services.log_of("executor")


def test_the_executor_says_what_it_loads_and_how_long_it_took(services):
    log = services.log_of("executor")
    loading = log.index("executor_svc: loading model preset:tiny (random weights) on cpu, float32")
    loaded = log.index("executor_svc: loaded model preset:tiny in ")
    assert loading < loaded < log.index("executor ready on")
    assert "\r" not in log  # no progress bar's carriage returns in a log file


def test_v1_reflection_on_both_services(services):
    for address, served in ((services.scheduler_address, "pagedserve.v1.Generator"),
                            (services.admin_address, "pagedserve.v1.Admin"),
                            (services.executor_address, "pagedserve.v1.Executor")):
        with grpc.insecure_channel(address) as channel:
            assert served in v1_services(channel)
