"""Start errors of both services are one line (what is wrong, which flag, what to do) and exit 2;
the traceback shows only at --log-level debug. Runs the mains in-process (no model loads), but
for the harness's start of real processes that cannot start."""
from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time

import pytest

from executor_svc import main as executor_main
from scheduler_svc import main as scheduler_main
from tests.integration.harness import START_TIMEOUT_S, free_port, start_services


def executor_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        executor_main.main(["--backend", "cpu", "--port", str(free_port()), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedserve-executor: error: ")
    return lines[0]


def test_missing_path(capsys, tmp_path):
    line = executor_error(capsys, "--model", str(tmp_path / "nope"))
    assert "--model" in line and "no such file or folder" in line and "preset:NAME" in line


def test_missing_gguf_names_no_download_url(capsys, tmp_path):
    line = executor_error(capsys, "--model", str(tmp_path / "model.gguf"))
    assert "--model" in line and "no such file or folder" in line
    assert "huggingface.co" not in line


def test_not_a_gguf_file(capsys, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    line = executor_error(capsys, "--model", str(fake))
    assert "--model" in line and "not a GGUF file" in line


def test_folder_without_config(capsys, tmp_path):
    line = executor_error(capsys, "--model", str(tmp_path))
    assert "--model" in line and "config.json" in line and "model_type" not in line


def test_unknown_preset(capsys):
    line = executor_error(capsys, "--model", "preset:nope")
    assert "--model preset:nope" in line and "known: " in line and "tiny" in line


def test_bad_executor_env_value(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_EXECUTOR_BLOCK_SIZE", "sixteen")
    line = executor_error(capsys)
    assert "PAGEDSERVE_EXECUTOR_BLOCK_SIZE='sixteen'" in line and "--block-size" in line


def test_debug_log_level_shows_traceback(capsys, tmp_path):
    with pytest.raises(SystemExit):
        executor_main.main(["--backend", "cpu", "--port", str(free_port()), "--log-level",
                            "DEBUG", "--model", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith(
        "pagedserve-executor: error: --model")


@pytest.mark.parametrize("variable,value,flag", [
    ("PAGEDSERVE_SCHEDULER_PORT", "http", "--port"),
    ("PAGEDSERVE_SCHEDULER_SHUTDOWN_TIMEOUT", "30s", "--shutdown-timeout"),
])
def test_bad_scheduler_env_value(capsys, monkeypatch, variable, value, flag):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        scheduler_main.parse_config([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"pagedserve-scheduler: error: {variable}={value!r} is not a valid "
                   f"{'int' if flag == '--port' else 'float'} (it sets {flag}): fix or unset it")


def test_scheduler_missing_executor_file(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        scheduler_main.parse_config(["--executor", f"@{tmp_path / 'executors'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedserve-scheduler: error: --executor @") and "\n" not in err


def test_whole_process_prints_one_line(tmp_path):
    """As a user sees it: no log lines, no traceback, just the error."""
    done = subprocess.run([sys.executable, "-m", "executor_svc.main", "--port", str(free_port()),
                           "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"pagedserve-executor: error: --model {tmp_path / 'nope'}: no such file or folder; give "
        "preset:NAME, a local Hugging Face folder (config.json + safetensors) or a .gguf file"]


@pytest.mark.parametrize("flag", ["--admin-token-file", "--executor-token-file"])
@pytest.mark.parametrize("case", ["missing", "empty", "both"])
def test_scheduler_token_files_are_checked(capsys, tmp_path, flag, case):
    path = tmp_path / "token"
    if case != "missing":
        path.write_text("" if case == "empty" else "secret\n")
    args = [flag, str(path)] + ([flag[:-5], "other"] if case == "both" else [])
    with pytest.raises(SystemExit) as exit_info:
        scheduler_main.parse_config(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and flag[:-5] in err


@pytest.mark.parametrize("case", ["missing", "empty", "both"])
def test_executor_token_file_is_checked(capsys, tmp_path, case):
    path = tmp_path / "token"
    if case != "missing":
        path.write_text("  \n" if case == "empty" else "secret\n")
    args = ["--auth-token-file", str(path)] + (["--auth-token", "other"] if case == "both" else [])
    with pytest.raises(SystemExit) as exit_info:
        executor_main.parse_config(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--auth-token" in err


def test_token_files_are_read_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text(" secret \n")
    _, transport, _ = executor_main.parse_config(["--auth-token-file", str(path)])
    config = scheduler_main.parse_config(["--executor-token-file", str(path),
                                          "--admin-token-file", str(path)])
    assert transport.auth_token == config.security.auth_token == config.admin_token == "secret"


def test_out_of_range_link_timings_are_refused(capsys):
    for main, args, flag in ((executor_main.parse_config, ["--hello-timeout", "-1"], "--hello-timeout"),
                             (executor_main.parse_config, ["--hello-timeout", "0"], "--hello-timeout"),
                             (scheduler_main.parse_config, ["--executor-keepalive", "0.1"],
                              "--executor-keepalive"),
                             (scheduler_main.parse_config, ["--executor-connect-timeout", "0"],
                              "--executor-connect-timeout"),
                             (scheduler_main.parse_config, ["--executor-retry-interval", "-1"],
                              "--executor-retry-interval")):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err


@pytest.mark.slow
def test_start_services_fails_at_once_when_the_executor_exits(tmp_path):
    """The harness (tests, bench_serving) stops waiting when a process it started exits, and
    says why, rather than waiting START_TIMEOUT_S for a scheduler that can never serve."""
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        start_services(tmp_path, ["--model", str(tmp_path / "nope")])
    assert time.monotonic() - started < START_TIMEOUT_S / 4
    message = str(err.value)
    assert "the executor exited with status 2" in message
    assert f"pagedserve-executor: error: --model {tmp_path / 'nope'}: no such file" in message


def test_executor_link_timings_reach_the_client(monkeypatch):
    """--step-timeout, --executor-connect-timeout and --executor-retry-interval (flag or
    environment) are what the scheduler's link to the executor uses."""
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_EXECUTOR_RETRY_INTERVAL", "0.5")
    default = scheduler_main.executor_client(scheduler_main.parse_config([]))
    assert (default.step_timeout_s, default.describe_timeout_s, default.max_backoff_s) == (
        60.0, 5.0, 0.5)
    client = scheduler_main.executor_client(scheduler_main.parse_config(
        ["--step-timeout", "7", "--executor-connect-timeout", "30",
         "--executor-retry-interval", "10"]))
    assert (client.step_timeout_s, client.describe_timeout_s, client.max_backoff_s) == (
        7.0, 30.0, 10.0)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--port", "--admin-port", "--http-port", "--metrics-port"])
def test_a_port_in_use_is_one_line_naming_its_flag(flag):
    """The real command, nothing but the line on its output, and a non-zero exit."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"--port": 0, "--admin-port": 0, "--http-port": 0, "--metrics-port": 0, flag: port}
        done = subprocess.run([sys.executable, "-m", "scheduler_svc.main", "--executor",
                               "127.0.0.1:1", *(str(x) for item in ports.items() for x in item)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"pagedserve-scheduler: error: {flag} {port}: cannot listen on 127.0.0.1:{port} (in use, "
        "or not an address here): Address already in use"]


def _lower_open_files(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@pytest.mark.slow
def test_the_http_cap_derives_from_the_open_file_limit_and_holds(tmp_path):
    """At an open-file limit of 400 the derived cap is 24 HTTP connections: of a flood of 600
    idle ones the newest 24 stay open (each newcomer takes an idle one's place) and the rest are
    closed or refused, never an accept failure (out of descriptors); a fresh client is served at
    once after."""
    http_port = free_port()
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc.main", "--executor", "127.0.0.1:1", "--port",
             "0", "--admin-port", "0", "--http-port", str(http_port)],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_lower_open_files(400))
    try:
        while "connections open at once" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        assert "connections open at once: HTTP 24, gRPC 4 (open-file limit 400)" in (
            log_path.read_text())
        flood = [socket.create_connection(("127.0.0.1", http_port)) for _ in range(600)]
        # until the server has taken the whole flood, however slow the host (a closed
        # connection stays closed)
        replies: list[bytes | None] = [None] * len(flood)
        deadline = time.monotonic() + 10
        while replies.count(None) > 24 and time.monotonic() < deadline:
            time.sleep(0.1)
            replies = [r if r is not None else _pending(s) for r, s in zip(replies, flood)]
        for sock in flood:
            sock.close()
        assert replies.count(None) == 24, replies
        assert set(replies) <= {None, b"", b"HTTP/1.1 429"}, replies
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", http_port), timeout=5) as fresh:
            fresh.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert fresh.recv(4096).startswith(b"HTTP/1.1 503 ")  # no executor: but served
        assert time.monotonic() - started < 1
        assert "cannot accept" not in log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def _pending(sock: socket.socket) -> bytes | None:
    """The start of what the server sent: b"" if it closed the connection, None if nothing."""
    sock.setblocking(False)
    try:
        return sock.recv(4096)[:12]
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""
