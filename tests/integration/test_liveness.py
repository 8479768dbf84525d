"""Faults seen while idle, a lease taken over, and a flood of wide requests, on real processes: an
idle executor killed is noticed within seconds (gRPC health and HTTP /health), a request then gets
UNAVAILABLE after the grace, and serving resumes once it is back; a scheduler whose lease another
takes over ends its streams at once with UNAVAILABLE and reports why; beside n = 16 requests, a
small request is refused at once or served, never left to wait out its deadline."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generate_pb2
from scheduler_svc.drain_rate import MIN_OBSERVED_S
from tests.integration.harness import (attach_scheduler, free_port, generate, start_services,
                                       wait_serving)
from tests.integration.test_end_to_end import TINY, random_prompts

pytestmark = pytest.mark.slow

GRACE_S = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5).status


def http_health(services) -> int:
    try:
        return urllib.request.urlopen(f"{services.http_url}/health", timeout=5).status
    except urllib.error.HTTPError as err:
        return err.code


def wait_until(predicate, timeout: float) -> float:
    """Seconds until `predicate()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - t0


def code_of(call) -> grpc.StatusCode | None:
    """Reads a Generate stream to its end: None if it finished, else its status code."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return None


def request(prompt: list[int], max_tokens: int, n: int = 1) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(n=n)
    req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    return req


def test_an_idle_executor_killed_is_noticed_and_served_again_once_back(tmp_path):
    # The retry interval has the executor attached again as soon as it serves.
    services = start_services(tmp_path, ["--model", TINY],
                              ["--unavailable-grace", str(GRACE_S), "--executor-keepalive", "2",
                               "--executor-retry-interval", "0.2"])
    try:
        prompt = random_prompts(1, seed=41)[0]
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = services.stub(channel)
            expected, _, _ = generate(stub, prompt, max_tokens=8)
            # A frozen host answers no ping: found by the link's keepalive (2 s here) and its
            # ping timeout, not a minute later; once it thaws the scheduler attaches it again.
            executor = services.procs["executor"]
            executor.send_signal(signal.SIGSTOP)
            try:
                assert wait_until(lambda: health(services.scheduler_address) == NOT_SERVING,
                                  12) < 12
            finally:
                executor.send_signal(signal.SIGCONT)
            wait_serving(services.scheduler_address, timeout=60)
            assert generate(stub, prompt, max_tokens=8)[0] == expected
            services.procs["executor"].kill()
            services.procs["executor"].wait()
            assert wait_until(lambda: health(services.scheduler_address) == NOT_SERVING, 5) < 5
            assert http_health(services) == 503
            assert not services.status().executor_attached
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:  # waits out the grace, not its deadline
                generate(stub, prompt, max_tokens=8, timeout=120)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < GRACE_S + 3
            port = int(services.executor_address.rsplit(":", 1)[1])
            services.add_executor("executor2", ["--model", TINY], port=port)
            wait_serving(services.scheduler_address, timeout=60)
            assert http_health(services) == 200
            assert generate(stub, prompt, max_tokens=8)[0] == expected
    finally:
        services.stop()


def start_scheduler(executor_address: str, args: list[str], log_path) -> tuple:
    """Another scheduler process on the same executor: (process, its address)."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "scheduler_svc.main", "--host", "127.0.0.1", "--port",
           address.rsplit(":", 1)[1], "--admin-port", str(free_port()), "--http-port", "0",
           "--executor", executor_address, *args]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT), address


def test_a_lease_taken_over_ends_the_first_schedulers_streams_at_once(tmp_path):
    token = ["--executor-token", "liveness-token"]
    services = start_services(tmp_path, ["--model", TINY, "--auth-token", "liveness-token"],
                              [*token, "--max-num-seqs", "16"])
    second = None
    try:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = services.stub(channel)
            calls = [stub.Generate(request(p, 1900), timeout=300)
                     for p in random_prompts(16, seed=42)]
            firsts = [next(call) for call in calls]  # every stream is running
            assert all(m.token_ids for m in firsts)
            second, address = start_scheduler(services.executor_address,
                                              [*token, "--executor-takeover"],
                                              tmp_path / "second.log")
            wait_serving(address, timeout=60)
            t0 = time.monotonic()
            codes = [code_of(call) for call in calls]
            assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
            assert time.monotonic() - t0 < 5
            assert health(services.scheduler_address) == NOT_SERVING
            status = services.status()
            assert not status.executor_attached
            assert "leased by another scheduler" in status.attach_error
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, random_prompts(1, seed=43)[0], max_tokens=4, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "leased by another scheduler" in err.value.details()
        with grpc.insecure_channel(address) as channel:
            assert len(generate(services.stub(channel), [5, 6, 7], max_tokens=4)[0]) == 4
    finally:
        if second is not None:
            second.terminate()
            second.wait(timeout=30)
        services.stop()


def http_completion(services, prompts: list[list[int]], n: int, headers: dict) -> tuple:
    """POST /v1/completions: (status, Retry-After, error message)."""
    body = json.dumps({"prompt": prompts, "max_tokens": 8, "n": n}).encode()
    req = urllib.request.Request(f"{services.http_url}/v1/completions", body, method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, None, ""
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("retry-after"), json.load(err)["error"]["message"]


def settled(status, outcomes: list) -> bool:
    """Every request of the flood either refused or in: one running, the rest waiting."""
    admitted = 1 + status.waiting // 16
    num_refused = sum(o is not None for o in outcomes)
    return status.running == 16 and status.waiting % 16 == 0 and \
        admitted + num_refused == len(outcomes) and num_refused > 0


def test_a_small_request_beside_a_flood_of_wide_ones_never_starves(tmp_path, tiny_executor):
    """16 seqs run, 5 or 6 requests of n = 16 wait (80 or 96 sequences of --max-waiting 100, as
    their samples happened to fork) and the rest of the flood is refused by the bound; a small
    request with a deadline is then refused at once, by the measured drain rate (over HTTP too:
    429 with Retry-After); a stream running before the flood completes unchanged, and a fresh
    client is served at once after it."""
    services = attach_scheduler(tmp_path, tiny_executor, ["--max-num-seqs", "16", "--max-waiting",
                                                          "100"])
    try:
        small = random_prompts(2, seed=44)
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = services.stub(channel)
            undisturbed = generate(stub, small[0], max_tokens=48)[0]
            bystander = stub.Generate(request(small[0], 48), timeout=300)
            flood = [stub.Generate(request(p, 1900, n=16), timeout=300)
                     for p in random_prompts(10, seed=45)]
            flooded_at = time.monotonic()
            outcomes: list = [None] * len(flood)

            def read(i: int) -> None:
                outcomes[i] = code_of(flood[i])
            readers = [threading.Thread(target=read, args=(i,)) for i in range(len(flood))]
            for reader in readers:
                reader.start()
            ids = [t for m in bystander for t in m.token_ids]
            assert ids == undisturbed
            wait_until(lambda: settled(services.status(), outcomes), 30)
            assert set(o for o in outcomes if o is not None) == {
                grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
            # the queue, backlogged since the flood came, has its drain rate measured by then
            time.sleep(max(flooded_at + MIN_OBSERVED_S + 1 - time.monotonic(), 0))
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, small[1], max_tokens=8, timeout=10)
            assert time.monotonic() - t0 < 1
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "deadline" in err.value.details() and "retry in" in err.value.details()
            pushback = dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"]
            assert 1000 <= int(pushback) <= 60_000
            for prompts, n, headers, reason in (
                    ([small[1]] * 2, 16, {}, "over --max-waiting"),  # no room for 32
                    ([small[1]], 1, {"x-stainless-read-timeout": "10"}, "deadline")):
                status, retry_after, message = http_completion(services, prompts, n, headers)
                assert status == 429 and 1 <= int(retry_after) <= 60 and reason in message
            for call in flood:  # the attack stops
                call.cancel()
            for reader in readers:
                reader.join(timeout=30)
            t0 = time.monotonic()
            assert len(generate(stub, small[1], max_tokens=8, timeout=10)[0]) == 8
            assert time.monotonic() - t0 < 1
    finally:
        services.stop()
