"""`pagedserve-client` as a subprocess against both services as real processes: health without a
prompt (and what it says at an executor's address), argument errors, defaults and the variable in
--help, the default max tokens and 0 for the model's length, no deadline on a live stream, the
executor's address named as such, exit statuses for Ctrl-C and for an aborted request, and the chat
mode with piped stdin."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from scheduler_svc.cli import DEFAULT_MAX_TOKENS
from tests.integration.harness import attach_scheduler, default_sigint, start_services

pytestmark = pytest.mark.slow

# A short max model length (above the client's default max tokens) keeps "generate up to the
# model's length" quick.
MAX_MODEL_LEN = 1024
assert MAX_MODEL_LEN > DEFAULT_MAX_TOKENS + 64
SUMMARY = re.compile(r"\[(FINISH_REASON_\w+), (\d+) prompt \+ (\d+) completion tokens\]")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    services = start_services(tmp_path_factory.mktemp("client"),
                              ["--model", "preset:tiny", "--max-model-len", str(MAX_MODEL_LEN)])
    yield services
    services.stop()


def client(address: str | None, *args: str, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scheduler_svc.cli", *args]
    if address:
        cmd += ["--address", address]
    # faulthandler: SIGABRT makes a hung client print every thread's stack (communicate)
    return subprocess.Popen(cmd, stdin=kwargs.pop("stdin", subprocess.DEVNULL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"}, **kwargs)


def communicate(proc: subprocess.Popen, data: bytes | None = None,
                timeout: float = 60) -> tuple[bytes, bytes]:
    """proc.communicate; a client still running after `timeout` seconds fails the test with
    every thread's stack (a rare hang after Ctrl-C in CI left nothing to go on)."""
    try:
        return proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the client still ran after {timeout}s; its stderr and threads:\n"
                    f"{err.decode(errors='replace')[-6000:]}")


def run_client(address: str | None, *args: str, stdin: str | None = None):
    """(exit status, stdout, stderr) of one client run."""
    proc = client(address, *args, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE)
    out, err = communicate(proc, stdin.encode() if stdin is not None else None, timeout=120)
    return proc.returncode, out.decode(), err.decode()


def summaries(stderr: str) -> list[tuple[str, int, int]]:
    return [(r, int(p), int(c)) for r, p, c in SUMMARY.findall(stderr)]


def first_output(proc: subprocess.Popen, services) -> bytes:
    """The client's first byte of answer; if it ends first, fails with how it ended. An error from
    the server would be on its stderr; a negative status is a signal from outside this test (as
    when a process of another run on the machine is killed by name and the pattern matches)."""
    first = proc.stdout.read(1)
    if not first:
        status, scheduler = proc.wait(timeout=60), services.procs["scheduler"].poll()
        pytest.fail(f"the client exited with status {status} before any token; its stderr: "
                    f"{proc.stderr.read().decode()!r}; the scheduler "
                    f"{'runs' if scheduler is None else f'exited with {scheduler}'}, its log:\n"
                    f"{services.log_of('scheduler')[-2000:]}")
    return first


def test_health_needs_no_prompt(tiny):
    code, out, err = run_client(tiny.scheduler_address, "--health")
    assert code == 0 and out == f"{tiny.scheduler_address}: SERVING\n", out + err
    code, out, err = run_client(tiny.scheduler_address, "--health", "--service", "scheduler")
    assert code == 0 and out == f"{tiny.scheduler_address}: SERVING\n", out + err


def test_health_at_the_executor_says_it_is_not_the_scheduler(tiny):
    """Bare --health (the compose files' probe of every service) says what it found; --service
    insists on one."""
    executor = tiny.executor_address
    code, out, err = run_client(executor, "--health")
    assert code == 0, err
    assert out == f"{executor}: SERVING (a pagedserve executor, not the scheduler)\n"
    assert run_client(executor, "--health", "--service", "executor")[0] == 0
    code, out, err = run_client(executor, "--health", "--service", "scheduler")
    assert code == 1 and out == ""
    assert err == f"{executor}: a pagedserve executor, not the scheduler (SERVING)\n"
    code, _, err = run_client(tiny.scheduler_address, "--health", "--service", "executor")
    assert code == 1 and "a pagedserve scheduler, not the executor" in err


def test_a_prompt_to_the_executor_names_the_mistake(tiny):
    code, out, err = run_client(tiny.executor_address, "What is the capital of France?")
    assert code == 1 and out == ""
    assert err == (f"error: {tiny.executor_address} is a pagedserve executor, not the scheduler: "
                   "prompts go to the scheduler's public address (127.0.0.1:50051 unless it was "
                   "changed)\n")


def test_a_prompt_to_the_http_port_names_the_mistake(tiny):
    address = f"127.0.0.1:{tiny.http_port}"
    code, out, err = run_client(address, "What is the capital of France?")
    assert code == 1 and out == ""
    assert err.startswith("error: UNAVAILABLE: ")
    assert err.endswith("(that address speaks HTTP/1, not gRPC: is it the OpenAI API's HTTP port? "
                        "pagedserve-client talks to the scheduler's gRPC address, 127.0.0.1:50051 "
                        "unless it was changed)\n")


def test_bad_token_ids_is_one_line_usage_error(tiny):
    code, out, err = run_client(tiny.scheduler_address, "--token-ids", "a,b")
    assert code == 2
    assert err == "pagedserve-client: --token-ids: expected comma-separated integers, got 'a'\n"


def test_help_shows_every_default_and_the_variable():
    code, out, _ = run_client(None, "--help")
    options = [line for line in out.splitlines() if line.startswith("  --")]
    assert code == 0 and len(options) > 15
    text = " ".join(out.split())
    assert text.count("(default: ") == len(options)  # --help itself has none
    assert f"(default: {DEFAULT_MAX_TOKENS})" in text and "(default: 300.0)" in text
    assert "(default: 127.0.0.1:50051; environment: PAGEDSERVE_CLIENT_ADDRESS)" in text


def test_the_default_max_tokens_ends_a_long_answer(tiny):
    code, out, err = run_client(tiny.scheduler_address, "--token-ids", "1,2,3", "--ignore-eos")
    assert code == 0, err
    [(reason, _, completion_tokens)] = summaries(err)
    assert reason == "FINISH_REASON_LENGTH" and completion_tokens == DEFAULT_MAX_TOKENS
    assert f"(stopped at --max-tokens {DEFAULT_MAX_TOKENS}: give more" in err


def test_max_tokens_0_generates_up_to_the_model_length(tiny):
    code, out, err = run_client(tiny.scheduler_address, "--token-ids", "1,2,3", "--ignore-eos",
                                "--max-tokens", "0")
    assert code == 0, err
    [(reason, prompt_tokens, completion_tokens)] = summaries(err)
    assert reason == "FINISH_REASON_LENGTH" and "stopped at" not in err
    assert prompt_tokens + completion_tokens == MAX_MODEL_LEN


def streamed(services, *args: str) -> tuple[int, str, float]:
    """(exit status, stderr, seconds from the answer's first byte to the client's exit)."""
    proc = client(services.scheduler_address, *args)
    first_output(proc, services)
    start = time.monotonic()
    _, err = communicate(proc)
    return proc.returncode, err.decode(), time.monotonic() - start


def test_a_stream_outlives_timeout_while_tokens_flow(tiny):
    """--timeout bounds the wait for each message, not the answer: an answer streamed for three
    times as long is streamed to its end."""
    args = ["--token-ids", "1,2,3", "--ignore-eos", "--max-tokens", "0", "--show-ids"]
    _, _, took = streamed(tiny, *args)
    timeout = took / 3
    code, err, took = streamed(tiny, *args, "--timeout", f"{timeout:.3f}")
    assert code == 0, err
    assert took > timeout  # the answer outlived the timeout
    [(_, prompt_tokens, completion_tokens)] = summaries(err)
    assert prompt_tokens + completion_tokens == MAX_MODEL_LEN


def test_ctrl_c_exits_130_without_traceback(tiny):
    proc = client(tiny.scheduler_address, "--token-ids", "1,2,3", "--ignore-eos", "--show-ids")
    first_output(proc, tiny)  # the first token is out: the answer is being streamed
    proc.send_signal(signal.SIGINT)
    _, err = communicate(proc)
    assert proc.returncode == 130
    assert err.decode().strip() == "pagedserve-client: interrupted"


def test_chat_keeps_the_history_and_resets_it(tiny):
    turns = "hello\nhello\n/reset\nhello\n"
    code, out, err = run_client(tiny.scheduler_address, "--chat", "--max-tokens", "8", stdin=turns)
    assert code == 0, err
    [first, second, third] = [prompt_tokens for _, prompt_tokens, _ in summaries(err)]
    # the second request carries the first turn and its answer; /reset drops them again
    assert second > first + 8 and third == first


def cancelled_count(services) -> float:
    return sum(v for k, v in services.metrics().items()
               if k.startswith("pagedserve_requests_finished") and "cancelled" in k)


def test_chat_ctrl_c_cancels_the_answer_and_goes_on(tiny):
    before = cancelled_count(tiny)
    proc = client(tiny.scheduler_address, "--chat", "--ignore-eos", "--show-ids",
                  stdin=subprocess.PIPE)
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    first_output(proc, tiny)
    proc.send_signal(signal.SIGINT)
    _, err = communicate(proc, b"hello\n")
    err = err.decode()
    assert proc.returncode == 0 and "[answer cancelled]" in err and "Traceback" not in err
    [(reason, prompt_tokens, completion_tokens)] = summaries(err)
    # the cancelled turn is not in the history: the second request is the first one again
    assert reason == "FINISH_REASON_LENGTH" and completion_tokens == DEFAULT_MAX_TOKENS
    assert cancelled_count(tiny) == before + 1


def test_aborted_request_exits_3(tmp_path, tiny_executor):
    # a drain far shorter than the answer (512 tokens): the request is still running when it ends
    services = attach_scheduler(tmp_path, tiny_executor, ["--shutdown-timeout", "0.2"])
    try:
        proc = client(services.scheduler_address, "--token-ids", "1,2,3", "--ignore-eos",
                      "--show-ids")
        first_output(proc, services)
        services.procs["scheduler"].send_signal(signal.SIGTERM)
        _, err = communicate(proc)
        assert proc.returncode == 3, err
        assert "FINISH_REASON_ABORTED" in err.decode() and "aborted" in err.decode()
    finally:
        services.stop()


def test_no_answer_within_timeout_ends_the_wait(tmp_path):
    """A scheduler with no executor yet holds the request: the client gives up after --timeout
    seconds without a message, and says so."""
    services = start_services(tmp_path, None, wait=False)
    try:
        deadline = time.monotonic() + 120
        while "NOT_SERVING" not in run_client(services.scheduler_address, "--health")[1]:
            assert time.monotonic() < deadline, services.log_of("scheduler")  # not listening
        start = time.monotonic()
        code, out, err = run_client(services.scheduler_address, "--token-ids", "1,2,3",
                                    "--timeout", "1")
        assert code == 1 and out == "" and time.monotonic() - start < 10
        assert err == "error: no answer from the server for 1s (--timeout)\n"
    finally:
        services.stop()
