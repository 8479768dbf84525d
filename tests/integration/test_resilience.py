"""Executors lost, hung, replaced or refused under load; cancellation; back-pressure; drain; health.

Every scenario runs real processes on localhost and checks outputs token for token against an
undisturbed reference (transformers greedy on the same weights) and that no page leaked.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generate_pb2, generate_pb2_grpc
from tests.integration.harness import (Services, attach_scheduler, free_port, generate,
                                       start_services, start_services_with, wait_serving)
from tests.integration.hf_reference import hf_greedy, hf_greedy_later
from tests.integration.test_end_to_end import TINY, assert_pools_whole, random_prompts

pytestmark = pytest.mark.slow


class Load:
    """N greedy streams in threads; `wait_tokens(k)` blocks until k tokens arrived in total.
    With a `reference` model, transformers' greedy output for each prompt is computed meanwhile,
    for check_against_reference."""

    def __init__(self, address: str, prompts: list[list[int]], max_tokens: int,
                 reference: str | None = None) -> None:
        self.address, self.prompts, self.max_tokens = address, prompts, max_tokens
        self.tokens = 0
        self.cond = threading.Condition()
        self.pool = ThreadPoolExecutor(len(prompts))
        self.futures = [self.pool.submit(self._one, p) for p in prompts]
        self.expected = hf_greedy_later(reference, prompts, max_tokens) if reference else None

    def _one(self, prompt):
        req = generate_pb2.GenerateRequest()
        req.token_ids.ids.extend(prompt)
        req.stopping.max_tokens = self.max_tokens
        req.stopping.ignore_eos = True
        ids, final = [], None
        with grpc.insecure_channel(self.address) as channel:
            stub = generate_pb2_grpc.GeneratorStub(channel)
            for msg in stub.Generate(req, timeout=300):
                if msg.finished:
                    final = msg
                    continue
                assert msg.index == len(ids), "duplicated or missing token"
                ids.extend(msg.token_ids)
                with self.cond:
                    self.tokens += len(msg.token_ids)
                    self.cond.notify_all()
        return ids, final

    def wait_tokens(self, k: int, timeout: float = 120) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.tokens >= k, timeout), self.tokens

    def results(self):
        out = [f.result(timeout=300) for f in self.futures]
        self.pool.shutdown()
        return out

    def check_against_reference(self):
        assert self.expected is not None, "Load(..., reference=MODEL) computes what to expect"
        results = self.results()
        for want, (ids, final) in zip(self.expected.result(timeout=300), results, strict=True):
            assert ids == want
            assert final.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def serving_executor(services) -> tuple[str, subprocess.Popen | None]:
    """(address, live process) of the executor the scheduler is attached to, or was last."""
    address = services.status().executor_address
    port = address.rsplit(":", 1)[1]
    for name, proc in services.procs.items():
        if name != "scheduler" and proc.poll() is None and \
                proc.args[proc.args.index("--port") + 1] == port:
            return address, proc
    return address, None


def kill_serving_executor(services) -> int:
    """SIGKILLs the executor the scheduler is attached to; returns its port."""
    address, proc = serving_executor(services)
    if proc is not None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return int(address.rsplit(":", 1)[1])


def replace_executor(services, port: int) -> None:
    """Starts another executor on `port` (as a supervisor would), under a name of its own."""
    services.add_executor(f"executor{len(services.procs)}", ["--model", TINY], port=port)


def kill_and_replace_executor(services) -> None:
    """SIGKILLs the executor, then starts another on its address (as a supervisor would)."""
    replace_executor(services, kill_serving_executor(services))


@dataclass
class Shared:
    services: Services
    spare: str  # an executor of the same model, outside the scheduler's addresses
    other: str  # an executor of another model


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One system for the scenarios that leave it serving after an executor is killed and
    replaced, moved or refused; they assert on how counters and logs changed. The retry
    interval has the replacement attached as soon as it serves."""
    services, [spare, other] = start_services_with(
        tmp_path_factory.mktemp("shared"), ["--model", TINY],
        ["--max-num-seqs", "8", "--executor-retry-interval", "0.2"],
        others={"spare": ["--model", TINY], "other": ["--model", "preset:tiny-qwen2"]})
    yield Shared(services, spare, other)
    services.stop()


@pytest.fixture()
def services(shared):
    """The shared system, serving: a scenario that failed midway and left no live executor
    attached has it replaced first."""
    try:
        wait_serving(shared.services.scheduler_address, timeout=30)
    except TimeoutError:
        kill_and_replace_executor(shared.services)
        wait_serving(shared.services.scheduler_address, timeout=60)
    return shared.services


def test_executor_sigkill_midway_then_replaced(services):
    resyncs = services.status().resyncs
    restarted = f"executor {serving_executor(services)[0]} restarted"
    restarts = services.log_of("scheduler").count(restarted)
    load = Load(services.scheduler_address, random_prompts(32, seed=11), max_tokens=48,
                reference=TINY)
    load.wait_tokens(200)
    kill_and_replace_executor(services)
    load.check_against_reference()
    assert services.status().resyncs > resyncs
    assert services.log_of("scheduler").count(restarted) > restarts
    assert_pools_whole(services)


def test_executor_sigkill_with_shared_prefixes_cached(services):
    """Prefix caching (on by default) across an executor lost: 32 streams share a system
    prompt, so their tables share cached pages when the executor dies; the new executor's cache
    is empty, every hash is dropped, and every stream still gets transformers' tokens."""
    resyncs = services.status().resyncs
    hits = services.metrics()["pagedserve_prefix_cache_hits_total"]
    system = random_prompts(1, seed=13, low=40, high=40)[0]
    prompts = [system + p for p in random_prompts(32, seed=14, low=1, high=8)]
    load = Load(services.scheduler_address, prompts, max_tokens=48, reference=TINY)
    load.wait_tokens(200)
    assert services.metrics()["pagedserve_prefix_cache_hits_total"] > hits
    kill_and_replace_executor(services)
    load.check_against_reference()
    assert services.status().resyncs > resyncs
    assert_pools_whole(services)


def test_planned_replacement_fails_no_request(shared, services):
    resyncs = services.status().resyncs
    _, old = serving_executor(services)
    load = Load(services.scheduler_address, random_prompts(32, seed=12), max_tokens=48,
                reference=TINY)
    load.wait_tokens(200)
    reply = services.set_executors(shared.spare)
    assert reply.address == shared.spare
    old.send_signal(signal.SIGTERM)  # the old one is no longer needed
    load.check_against_reference()
    status = services.status()
    assert status.executor_address == shared.spare and status.resyncs == resyncs
    assert_pools_whole(services)


def test_switch_to_a_different_model_is_refused(shared, services):
    refusals = services.log_of("scheduler").count("refusing executor")
    with pytest.raises(grpc.RpcError) as err:
        services.set_executors(shared.other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert services.log_of("scheduler").count("refusing executor") > refusals
    with grpc.insecure_channel(services.scheduler_address) as channel:
        ids, _, _ = generate(services.stub(channel), [3, 4, 5], max_tokens=4)
    assert ids == hf_greedy(TINY, [3, 4, 5], 4)


def test_health_follows_the_executor(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        port = kill_serving_executor(services)
        # The loss is noticed at the next step: send one.
        threading.Thread(target=lambda: _try_generate(services), daemon=True).start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        replace_executor(services, port)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_hung_executor_is_detected_and_next_address_takes_over(tmp_path):
    backup_port = free_port()
    # The hung executor still accepts connections: its Describe waits out the connect timeout
    # before the next address is tried.
    with start_services(tmp_path, ["--model", TINY],
                        ["--step-timeout", "2", "--executor-connect-timeout", "1"],
                        extra_executor_addresses=(f"127.0.0.1:{backup_port}",)) as services:
        services.add_executor("backup", ["--model", TINY], port=backup_port)
        load = Load(services.scheduler_address, random_prompts(16, seed=13), max_tokens=48,
                    reference=TINY)
        load.wait_tokens(100)
        services.procs["executor"].send_signal(signal.SIGSTOP)
        try:
            load.check_against_reference()
        finally:
            services.procs["executor"].send_signal(signal.SIGCONT)
        status = services.status()
        assert status.executor_address == f"127.0.0.1:{backup_port}" and status.resyncs >= 1
        assert_pools_whole(services)


def test_cancelling_half_the_streams_frees_their_pages(tiny_services):
    # Its default --max-num-seqs (128 on CPU, test_step_limits) runs all 100 at once.
    services = tiny_services
    prompts = random_prompts(100, seed=14)
    cancel_after = 4
    with grpc.insecure_channel(services.scheduler_address) as channel:
        stub = services.stub(channel)
        calls = []
        for prompt in prompts:
            req = generate_pb2.GenerateRequest()
            req.token_ids.ids.extend(prompt)
            req.stopping.max_tokens = 64
            req.stopping.ignore_eos = True
            calls.append(stub.Generate(req, timeout=300))
        for call in calls[:50]:  # read a few tokens from the first 50, then hang up
            for _ in range(cancel_after):
                next(call)
            call.cancel()
        steps_at_cancel = services.status().steps
        status = services.status()
        deadline = time.monotonic() + 60  # the server sees each cancellation asynchronously
        while status.running + status.waiting + status.swapped > 50:
            assert time.monotonic() < deadline, status
            status = services.status()
        assert status.steps - steps_at_cancel <= 1, (status.steps, steps_at_cancel)
        # only now: a reference computed in this process could delay the polls above
        expected = hf_greedy_later(TINY, prompts[50:], 64)
        kept = [[t for m in call for t in m.token_ids] for call in calls[50:]]
    assert kept == expected.result(timeout=300)
    assert_pools_whole(services)


def test_full_waiting_queue_answers_resource_exhausted(tmp_path, tiny_executor):
    with attach_scheduler(tmp_path, tiny_executor,
                          ["--max-num-seqs", "2", "--max-waiting", "3"]) as services:
        prompts = random_prompts(24, seed=15)
        with grpc.insecure_channel(services.scheduler_address) as channel, ThreadPoolExecutor(24) as pool:
            stub = services.stub(channel)

            def run(prompt):
                try:
                    return generate(stub, prompt, max_tokens=32)[0]
                except grpc.RpcError as err:
                    return err.code()
            outcomes = list(pool.map(run, prompts))
        refused = [o for o in outcomes if o == grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [(p, o) for p, o in zip(prompts, outcomes) if isinstance(o, list)]
        assert refused and served and len(refused) + len(served) == len(prompts)
        for prompt, ids in served:
            assert ids == hf_greedy(TINY, prompt, 32)
        assert_pools_whole(services)


def test_sigterm_drains_then_ends_the_rest(tmp_path, tiny_executor):
    with attach_scheduler(tmp_path, tiny_executor,
                          ["--shutdown-timeout", "1", "--max-num-seqs", "1"]) as services:
        long_prompts = random_prompts(3, seed=16)
        load = Load(services.scheduler_address, long_prompts, max_tokens=1500)
        load.wait_tokens(5)
        services.procs["scheduler"].send_signal(signal.SIGTERM)
        results = load.results()
        assert all(final is not None for _, final in results)
        assert any(final.finish_reason == generate_pb2.FINISH_REASON_ABORTED for _, final in results)
        assert services.procs["scheduler"].wait(timeout=60) == 0
        assert "shutting down" in services.log_of("scheduler")


def _try_generate(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        try:
            generate(services.stub(channel), [1, 2, 3], max_tokens=2, timeout=120)
        except grpc.RpcError:
            pass


def _self_signed_cert(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(key), str(cert)


def test_tls_and_token_on_the_executor_link(tmp_path):
    key, cert = _self_signed_cert(tmp_path)
    with start_services(
        tmp_path,
        ["--model", TINY, "--tls-cert", cert, "--tls-key", key, "--auth-token", "s3cret"],
        ["--executor-tls-ca", cert, "--executor-tls-server-name", "localhost",
         "--executor-token", "s3cret"]) as services:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            ids, _, _ = generate(services.stub(channel), [7, 8, 9], max_tokens=6)
        assert ids == hf_greedy(TINY, [7, 8, 9], 6)
        # A client without the token is refused by the executor.
        from protos import executor_pb2, executor_pb2_grpc
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(services.executor_address, creds,
                                 options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                executor_pb2_grpc.ExecutorStub(ch).Describe(executor_pb2.DescribeRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_sighup_rereads_the_executor_file(tmp_path):
    executors = tmp_path / "executors"
    services, [new_address] = start_services_with(tmp_path, ["--model", TINY],
                                                  ["--max-num-seqs", "8"],
                                                  others={"executor2": ["--model", TINY]},
                                                  executor_file=executors)
    try:
        load = Load(services.scheduler_address, random_prompts(16, seed=17), max_tokens=48,
                    reference=TINY)
        load.wait_tokens(100)
        executors.write_text(new_address + "\n")
        services.procs["scheduler"].send_signal(signal.SIGHUP)
        load.check_against_reference()
        assert "SIGHUP: now serving from " + new_address in services.log_of("scheduler")
        assert services.status().executor_address == new_address
        assert_pools_whole(services)
    finally:
        services.stop()
