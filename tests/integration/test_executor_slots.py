"""The executor's RPC slots under attack, real processes on localhost: 200 calls of every method
that send their headers and never a message, each reopened as soon as the executor ends it, with
and without an executor token. Meanwhile a bystander stream completes unchanged, health answers
SERVING, a restarted scheduler attaches, and once the attack stops a fresh client is served
within a second.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import executor_pb2, executor_pb2_grpc, reflection
from tests.integration.harness import free_port, generate, start_services, wait_serving
from tests.integration.test_end_to_end import TINY, random_prompts

pytestmark = pytest.mark.slow

TOKEN = "slots-test-token"
METHODS = ["/pagedserve.v1.Executor/Describe", "/pagedserve.v1.Executor/Execute",
           "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", *reflection.METHODS]
PER_METHOD = 200
PROMPT = random_prompts(1, seed=31)[0]


@pytest.fixture(scope="module", params=[False, True], ids=["no-token", "token"])
def system(request, tmp_path_factory):
    """Executor + scheduler (with the executor token or without), and the bystander's tokens
    from an undisturbed run."""
    token = TOKEN if request.param else None
    executor_args = ["--model", TINY, "--hello-timeout", "2"]
    scheduler_args = ["--max-num-seqs", "8"]
    if token:
        executor_args += ["--auth-token", token]
        scheduler_args += ["--executor-token", token]
    services = start_services(tmp_path_factory.mktemp("slots"), executor_args, scheduler_args)
    with grpc.insecure_channel(services.scheduler_address) as channel:
        reference, _, _ = generate(services.stub(channel), PROMPT, max_tokens=48)
    yield services, token, reference
    services.stop()


def executor_serving(address: str, token: str | None, timeout: float) -> None:
    """Health SERVING and Describe answered, each within `timeout`."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=timeout)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(),
                                                         timeout=timeout, metadata=metadata)


def restart_scheduler(services, token: str | None) -> str:
    """Kills the scheduler and starts another on the same executor; its address once serving."""
    services.procs["scheduler"].kill()
    services.procs["scheduler"].wait()
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "scheduler_svc.main", "--host", "127.0.0.1", "--port",
           address.rsplit(":", 1)[1], "--admin-port", str(free_port()), "--http-port", "0",
           "--executor", services.executor_address, "--executor-retry-interval", "0.2"]
    if token:
        cmd += ["--executor-token", token]
    log = open(services.logs["scheduler"].replace("scheduler.log", "scheduler2.log"), "w")
    services.procs["scheduler2"] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_serving(address, timeout=60, procs={"scheduler": services.procs["scheduler2"]})
    return address


@contextmanager
def silent_calls(address: str):
    """PER_METHOD silent calls of every method, held by another process; yields a dict that gets
    their counts ({method: {"opened", "ended", "goaways"}}) when the attack stops."""
    attack = subprocess.Popen([sys.executable, "-m", "tests.integration.silent_calls", address,
                               str(PER_METHOD), *METHODS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    counts = {}
    try:
        assert attack.stdout.readline().strip() == "holding"
        yield counts
    finally:
        out, _ = attack.communicate(timeout=30)
    counts.update(json.loads(out))


def threads_of(proc: subprocess.Popen) -> int:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_silent_calls_of_every_method_starve_nothing(system):
    services, token, reference = system
    executor = services.procs["executor"]
    idle_threads = threads_of(executor)
    bystander = {}
    with grpc.insecure_channel(services.scheduler_address) as channel, \
            silent_calls(services.executor_address) as counts:
        thread = threading.Thread(target=lambda: bystander.update(
            ids=generate(services.stub(channel), PROMPT, max_tokens=48)[0]))
        thread.start()
        executor_serving(services.executor_address, token, timeout=5)
        thread.join(timeout=120)
        assert bystander["ids"] == reference
        assert threads_of(executor) < idle_threads + 250  # each method's pool, not a thread a call
        address = restart_scheduler(services, token)
        with grpc.insecure_channel(address) as fresh:
            assert generate(services.stub(fresh), PROMPT, max_tokens=48)[0] == reference
        executor_serving(services.executor_address, token, timeout=5)
    for method in METHODS:  # the executor kept ending them, and each was opened again
        assert counts[method]["ended"] > PER_METHOD, (method, counts[method])
    start = time.monotonic()
    with grpc.insecure_channel(address) as fresh:
        assert generate(services.stub(fresh), PROMPT, max_tokens=4)[0] == reference[:4]
    executor_serving(services.executor_address, token, timeout=1.0)
    assert time.monotonic() - start < 1.0
