"""The scheduler's main: --help words every flag's default and environment variable, connection
caps derive from the open-file limit, and the line saying no executor is attached stays silent
while one is being attached."""
import asyncio
import logging
import re
import resource
import time
from types import SimpleNamespace

import pytest

from scheduler_svc import main


def test_every_flag_says_its_default_and_its_environment_variable(monkeypatch):
    for action in main.build_parser()._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[-1]
        variable = "PAGEDSERVE_SCHEDULER_" + flag[2:].upper().replace("-", "_")
        assert action.help and "(default: " in action.help, flag
        assert action.help.endswith(f"; env {variable})"), (flag, action.help)


def test_help_shows_the_built_in_default_not_the_environments(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_MAX_WAITING", "7")
    with pytest.raises(SystemExit):
        main.build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 4096; env PAGEDSERVE_SCHEDULER_MAX_WAITING)" in text
    assert main.parse_config([]).engine.max_waiting == 7


@pytest.mark.parametrize("open_files,http,grpc,batch", [
    (1024, 336, 56, 16), (512, 80, 13, 16), (20000, 8264, 1377, 256),
    (1 << 20, 16384, 87092, 256)])
def test_connection_caps_derive_from_the_open_file_limit(monkeypatch, open_files, http, grpc,
                                                         batch):
    assert main.connection_caps(open_files) == (http, grpc, batch)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (open_files, open_files))
    config = main.parse_config([])
    limits = config.http_limits
    assert (limits.max_connections, config.grpc_limits.max_connections, limits.accept_batch) == (
        http, grpc, batch)
    # the HTTP connections held, lingering or passing, the gRPC ones (three descriptors each
    # behind the gate) and the reserve fit
    assert limits.max_descriptors() + config.grpc_limits.max_descriptors() + 128 <= open_files


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda what, limits: calls.append(limits))
    main.raise_open_file_limit()
    assert calls == [(4096, 4096)]


def test_caps_the_open_file_limit_cannot_hold_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    config = main.parse_config(["--http-max-connections", "550", "--grpc-max-connections", "10"])
    # HTTP 550 + 84 lingering + 80 passing; gRPC 3 x 10 + 128 passing; 128 reserved: 1,000
    assert config.http_limits.max_connections == 550
    with pytest.raises(SystemExit):
        main.parse_config(["--http-max-connections", "900"])
    err = capsys.readouterr().err
    assert "--http-max-connections 900" in err and "ulimit -n is 1024" in err


def test_http_timeouts_are_flags():
    limits = main.parse_config(["--http-header-timeout", "3", "--http-body-timeout", "4",
                                "--http-keep-alive-timeout", "6"]).http_limits
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_timeout_s) == (
        3, 4, 6)
    with pytest.raises(SystemExit):
        main.parse_config(["--http-header-timeout", "0"])


def test_no_waiting_line_while_an_executor_is_being_attached(caplog):
    """The client logs `attached executor` when its stream opens; the engine attaches once the
    tokenizer loaded, seconds later (the GGUF's): no `still no executor` line in between."""
    client = SimpleNamespace(disconnected_since=time.monotonic())
    engine = SimpleNamespace(client=client, attached=False, status=lambda: SimpleNamespace(
        attached=engine.attached, attach_error="waiting for an executor at x"))

    async def scenario():
        task = asyncio.create_task(main._log_while_detached(engine, 0.05))
        while len(caplog.records) < 2:  # nothing is connected: a line every interval
            await asyncio.sleep(0.01)
        client.disconnected_since = None  # the stream is up: the tokenizer loads
        num_lines = len(caplog.records)
        await asyncio.sleep(0.3)
        assert len(caplog.records) == num_lines
        engine.attached = True
        await asyncio.sleep(0.1)
        task.cancel()
        return num_lines
    with caplog.at_level(logging.INFO, "scheduler_svc"):
        num_lines = asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == num_lines
    waited = [float(re.match(r"still no executor attached after ([0-9.]+)s: waiting for an "
                             r"executor at x$", line).group(1)) for line in lines]
    # the line prints 3 significant digits: allow that rounding
    assert waited[0] >= 0.0495 and waited[1] >= waited[0] + 0.049


def test_the_waiting_line_counts_from_the_loss_not_the_last_tick(caplog):
    """An executor lost just before a tick is not reported as missing for a whole interval."""
    client = SimpleNamespace(disconnected_since=None)
    engine = SimpleNamespace(client=client, status=lambda: SimpleNamespace(
        attached=client.disconnected_since is None, attach_error="executor lost"))

    async def scenario():
        task = asyncio.create_task(main._log_while_detached(engine, 0.2))
        await asyncio.sleep(0.15)
        client.disconnected_since = time.monotonic()  # lost 0.05 s before the first tick
        await asyncio.sleep(0.1)
        assert not caplog.records  # the tick at 0.2 s: lost for 0.05 s only
        await asyncio.sleep(0.2)  # the tick at 0.4 s: lost for 0.25 s
        task.cancel()
    with caplog.at_level(logging.INFO, "scheduler_svc"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("still no executor attached after 0.2")


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_grammar_timeout_that_is_not_positive_is_one_usage_line(value, capsys):
    with pytest.raises(SystemExit) as exited:
        main.parse_config(["--grammar-timeout", value])
    assert exited.value.code == 2
    assert f"--grammar-timeout must be > 0 seconds, got {float(value)}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,env,says", [
    (["--max-num-seqs", "0"], {}, "--max-num-seqs must be >= 1, got 0"),
    (["--max-num-batched-tokens", "-5"], {}, "--max-num-batched-tokens must be >= 1, got -5"),
    (["--enable-auto-tool-choice"], {}, "--enable-auto-tool-choice needs --tool-call-parser"),
    ([], {"PAGEDSERVE_SCHEDULER_TOOL_CALL_PARSER": "mistral"},
     "--tool-call-parser must be one of hermes, llama3_json (from "
     "PAGEDSERVE_SCHEDULER_TOOL_CALL_PARSER), got 'mistral'"),
    ([], {"PAGEDSERVE_SCHEDULER_PREEMPTION_MODE": "evict"},
     "--preemption-mode must be one of swap, recompute (from "
     "PAGEDSERVE_SCHEDULER_PREEMPTION_MODE), got 'evict'"),
    ([], {"PAGEDSERVE_SCHEDULER_LOG_LEVEL": "verbose"},
     "--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (from "
     "PAGEDSERVE_SCHEDULER_LOG_LEVEL), got 'VERBOSE'"),
    (["--log-level", "verbose"], {}, "invalid choice: 'VERBOSE'"),
    (["--port", "99999"], {}, "--port must be a port number, 0 to 65535, got 99999"),
    (["--http-port", "-1"], {}, "--http-port must be a port number, 0 to 65535, got -1"),
    (["--max-waiting", "0"], {}, "--max-waiting must be >= 1, got 0"),
    (["--max-prompt-bytes", "0"], {}, "--max-prompt-bytes must be >= 1, got 0"),
    (["--max-chat-messages", "-1"], {}, "--max-chat-messages must be >= 1, got -1"),
    (["--shutdown-timeout", "nan"], {}, "--shutdown-timeout must be >= 0 seconds, got nan"),
    (["--unavailable-grace", "-3"], {}, "--unavailable-grace must be >= 0 seconds, got -3.0"),
    (["--step-timeout", "0"], {}, "--step-timeout must be > 0 seconds, got 0.0"),
    (["--executor", ",,"], {}, "--executor ',,' names no address"),
])
def test_a_bad_flag_value_is_one_usage_line(argv, env, says, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main.parse_config(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("given", ["debug", "Warning"])
def test_the_log_level_takes_any_case_from_the_flag_and_the_variable(given, monkeypatch):
    assert main.parse_config(["--log-level", given]).log_level == given.upper()
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_LOG_LEVEL", given)
    assert main.parse_config([]).log_level == given.upper()


def test_the_executor_ca_bundle_is_read_at_start(tmp_path, capsys):
    """A missing or non-PEM CA file is one usage line at start, not link attempts failing."""
    (tmp_path / "text.pem").write_text("not a certificate\n")
    for path, says in [(tmp_path / "none.pem", "No such file or directory"),
                       (tmp_path / "text.pem", "not a readable PEM CA bundle")]:
        with pytest.raises(SystemExit) as exited:
            main.parse_config(["--executor-tls-ca", str(path)])
        assert exited.value.code == 2
        assert f"--executor-tls-ca {path}: " in (err := capsys.readouterr().err) and says in err
