"""The scheduler's trust boundaries and request limits, against real processes: Admin lives on its
own listener behind a token, oversized or malformed requests get a clear error before any work,
and a scheduler that is not ready says why instead of answering UNKNOWN."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from protos import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.integration.harness import (free_port, generate, start_executor, start_services,
                                       wait_serving)

pytestmark = pytest.mark.slow
TOKEN = "admin-secret-for-tests"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    s = start_services(tmp_path_factory.mktemp("security"),
                       ["--model", "preset:tiny", "--log-level", "DEBUG"],
                       ["--log-level", "DEBUG"], admin_token=TOKEN)
    yield s
    s.stop()


def call_admin(address: str, metadata=()):
    with grpc.insecure_channel(address) as channel:
        return admin_pb2_grpc.AdminStub(channel).SetExecutors(
            admin_pb2.SetExecutorsRequest(addresses=["127.0.0.1:1"]), timeout=10,
            metadata=metadata)


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_admin_is_refused_on_the_public_listener(services):
    code, details = code_of(lambda: call_admin(services.scheduler_address))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "not served on the public listener" in details
    assert "refused /pagedserve.v1.Admin/SetExecutors from" in services.log_of("scheduler")


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),),
                                      (("authorization", TOKEN),)])
def test_admin_without_its_token_is_unauthenticated(services, metadata):
    code, details = code_of(lambda: call_admin(services.admin_address, metadata))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "admin token" in details
    assert "missing or wrong admin token" in services.log_of("scheduler")


def test_admin_with_its_token_works(services):
    status = services.status()  # the harness sends the token
    assert status.executor_attached and status.model_name == "preset:tiny"
    code, _ = code_of(lambda: call_admin(services.admin_address,
                                         (("authorization", f"Bearer {TOKEN}"),)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # no executor at 127.0.0.1:1


def run_scheduler(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scheduler_svc.main", "--http-port", "0", *args],
                          capture_output=True, text=True, timeout=60)


def test_admin_beyond_loopback_needs_a_token():
    done = run_scheduler("--port", str(free_port()), "--admin-host", "0.0.0.0")
    assert done.returncode != 0
    assert "not a loopback address: set --admin-token" in done.stderr


@pytest.mark.parametrize("which", ["public", "admin"])
def test_a_busy_port_fails_at_start(services, which):
    public, admin = services.scheduler_address, services.admin_address
    port = (public if which == "public" else admin).rsplit(":", 1)[1]
    other = str(free_port())
    args = (["--port", port, "--admin-port", other] if which == "public"
            else ["--port", other, "--admin-port", port])
    done = run_scheduler(*args, "--executor", services.executor_address)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def rpc_error(stub, req: generate_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=60))
    return info.value.code(), info.value.details(), time.monotonic() - t0


def oversized_requests() -> dict[str, tuple[generate_pb2.GenerateRequest, set]]:
    invalid, any_refusal = ({grpc.StatusCode.INVALID_ARGUMENT},
                            {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
    cases = {}
    cases["10 MB prompt"] = (generate_pb2.GenerateRequest(text="word " * 2_000_000), any_refusal)
    cases["1 MiB + 1 prompt"] = (generate_pb2.GenerateRequest(text="a" * (2**20 + 1)), invalid)
    req = generate_pb2.GenerateRequest()
    for _ in range(10_000):
        req.chat.messages.add(role="user", content="hi")
    cases["10,000 chat messages"] = (req, invalid)
    req = generate_pb2.GenerateRequest(text="hi")
    req.stopping.stop.extend(["x" * 10_000] * 1_000)
    cases["1,000 stop strings of 10 kB"] = (req, any_refusal)
    req = generate_pb2.GenerateRequest(text="hi")
    req.stopping.stop.extend(["x" * 10_000] * 40)
    cases["40 stop strings of 10 kB"] = (req, invalid)
    req = generate_pb2.GenerateRequest(text="hi")
    req.stopping.stop_token_ids.extend(range(10**6, 10**6 + 2_000))
    cases["2,000 unknown stop ids"] = (req, invalid)
    cases["1 MB request id"] = (generate_pb2.GenerateRequest(text="hi", request_id="r" * 10**6),
                                invalid)
    cases["request id with a newline"] = (
        generate_pb2.GenerateRequest(text="hi", request_id="a\nINFO forged"), invalid)
    return cases


@pytest.mark.parametrize("name", list(oversized_requests()))
def test_oversized_requests_get_a_clear_error_at_once(services, name):
    req, codes = oversized_requests()[name]
    with grpc.insecure_channel(services.scheduler_address) as channel:
        code, details, seconds = rpc_error(generate_pb2_grpc.GeneratorStub(channel), req)
    assert code in codes, (code, details)
    assert len(details) <= 1024
    assert seconds < 2.0, f"{name} took {seconds:.2f}s to refuse"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details.split(":")[0] in ("prompt.text", "prompt.chat.messages", "stop",
                                         "stop_token_ids", "request_id")


def test_request_ids_are_logged(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        req = generate_pb2.GenerateRequest(request_id="req-logged-1")
        req.token_ids.ids.extend([5, 6, 7])
        req.stopping.max_tokens = 3
        replies = list(stub.Generate(req, timeout=60))
    assert {r.request_id for r in replies} == {"req-logged-1"}
    log = services.log_of("scheduler")
    assert "DEBUG scheduler_svc.output: request req-logged-1 finished (length): 3 prompt + 3 " \
        "generated tokens" in log


@pytest.mark.parametrize("name,ready,frozen_first", [("scheduler", "scheduler ready", True),
                                                     ("executor", "executor ready on", False)])
def test_both_services_freeze_their_startup_heap_once_ready(services, name, ready, frozen_first):
    """(Not a security matter: this fixture is the one at DEBUG.) The objects alive when a
    service is ready are out of the collector's scans, a full collection's pause with them. The
    scheduler freezes just before its health first goes SERVING (so before it logs that it is
    ready): a client that starts on SERVING must not wait for that collection."""
    from tests.integration.test_observability import wait_for_line

    line = wait_for_line(services, name, "frozen out of the garbage collector")
    assert int(line.split(f"DEBUG {name}_svc: ")[1].split()[0]) > 10_000
    wait_for_line(services, name, ready)
    log = services.log_of(name)
    assert (log.index(line) < log.index(ready)) == frozen_first


def test_not_ready_is_unavailable_with_a_reason(tmp_path):
    """No executor yet: ModelInfo is UNAVAILABLE, GetStatus says why, Generate waits for the
    executor within the grace period and is then served."""
    services = start_services(tmp_path, None, ["--unavailable-grace", "60"], wait=False)
    try:
        _wait_listening(services.admin_address)
        status = services.status()
        assert not status.executor_attached
        assert "waiting for an executor" in status.attach_error
        with grpc.insecure_channel(services.scheduler_address) as channel:
            code, details = code_of(lambda: generate_pb2_grpc.GeneratorStub(channel).ModelInfo(
                generate_pb2.ModelInfoRequest(), timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE and "no executor attached" in details
            result = {}
            waiting = threading.Thread(target=lambda: result.update(
                out=generate(generate_pb2_grpc.GeneratorStub(channel), [5, 6, 7], max_tokens=4)))
            waiting.start()
            port = int(services.executor_address.rsplit(":", 1)[1])
            services.procs["executor"] = start_executor(["--model", "preset:tiny"], port,
                                                        services.logs["executor"])
            waiting.join(timeout=240)
        ids, _, final = result["out"]
        assert len(ids) == 4 and final.completion_tokens == 4
        assert services.status().executor_attached
    finally:
        services.stop()


def _wait_listening(address: str, timeout: float = 60) -> None:
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)


def _status_when(services, predicate, timeout: float = 120):
    """GetStatus, polled until `predicate(status)` (the scheduler offers no stream of it)."""
    deadline = time.monotonic() + timeout
    while True:
        status = services.status()
        if predicate(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_a_tokenizer_that_does_not_load_is_reported_and_retried(tmp_path):
    """Item 7: an attach failure is logged at once and shown by health and GetStatus, never
    'ready'; once the tokenizer is mended the scheduler attaches and serves text. A folder with
    no tokenizer at all serves token ids and refuses text with INVALID_ARGUMENT."""
    from executor_svc.model_loader import build_hf_model
    from executor_svc.model_loader import smollm2_gguf_path
    from scheduler_svc.tokenizer import load_tokenizer

    folder = tmp_path / "model"
    build_hf_model("tiny", seed=0).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{not json")
    services = start_services(tmp_path, ["--model", str(folder)], ["--unavailable-grace", "1"],
                              wait=False)
    try:
        _wait_listening(services.admin_address)
        status = _status_when(services, lambda s: "failed" in s.attach_error)
        assert not status.executor_attached and "tokenizer" in status.attach_error
        log = services.log_of("scheduler")
        assert "ERROR" in log and "scheduler ready" not in log
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = generate_pb2_grpc.GeneratorStub(channel)
            code, details = code_of(lambda: list(stub.Generate(
                generate_pb2.GenerateRequest(text="hi"), timeout=30)))
            assert code == grpc.StatusCode.UNAVAILABLE and "failed" in details
        load_tokenizer(smollm2_gguf_path()).hf_tokenizer.save_pretrained(folder)  # mended
        wait_serving(services.scheduler_address)
        with grpc.insecure_channel(services.scheduler_address) as channel:
            ids, text, final = generate(generate_pb2_grpc.GeneratorStub(channel), text="Hello",
                                        max_tokens=3)
        assert len(ids) == 3 and final.prompt_tokens > 0
        assert "scheduler ready" in services.log_of("scheduler")
    finally:
        services.stop()


def test_a_model_without_tokenizer_serves_token_ids(tmp_path):
    from executor_svc.model_loader import build_hf_model

    folder = tmp_path / "model"
    build_hf_model("tiny", seed=0).save_pretrained(folder)
    services = start_services(tmp_path, ["--model", str(folder)])
    try:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            stub = generate_pb2_grpc.GeneratorStub(channel)
            ids, _, _ = generate(stub, [5, 6, 7], max_tokens=3)
            assert len(ids) == 3
            for req in (generate_pb2.GenerateRequest(text="hi"),
                        generate_pb2.GenerateRequest(chat={"messages": [{"role": "user",
                                                                         "content": "hi"}]})):
                code, details, _ = rpc_error(stub, req)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "no tokenizer" in details
    finally:
        services.stop()


def test_an_executor_beyond_loopback_needs_a_token():
    done = subprocess.run([sys.executable, "-m", "executor_svc.main", "--host", "0.0.0.0",
                           "--port", str(free_port()), "--model", "preset:tiny"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "not a loopback address: set --auth-token" in done.stderr
