"""`pagedserve-executor --help`: every flag says what it does, its default and its environment
variable, and that variable really sets it."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from executor_svc import main as executor_main

ENV = executor_main._ENV_PREFIX


def options() -> list[argparse.Action]:
    return [a for a in executor_main.build_parser()._actions if a.dest != "help"]


def variable(action: argparse.Action) -> str:
    return ENV + action.option_strings[0][2:].upper().replace("-", "_")


@pytest.mark.parametrize("action", options(), ids=lambda a: a.option_strings[0])
def test_every_flag_says_its_default_and_its_variable(action):
    assert action.help and "(default: " in action.help
    assert f"environment: {variable(action)}" in action.help


def sample(action: argparse.Action) -> str:
    """A valid value of the flag's variable, other than its default."""
    if action.nargs == 0:  # a switch
        return "1"
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    return {int: "7", float: "0.5"}.get(action.type, "/some/value")


@pytest.mark.parametrize("action", options(), ids=lambda a: a.option_strings[0])
def test_every_variable_sets_its_flag(action, monkeypatch):
    unset = getattr(executor_main.build_parser().parse_args([]), action.dest)
    monkeypatch.setenv(variable(action), sample(action))
    assert getattr(executor_main.build_parser().parse_args([]), action.dest) != unset


def test_the_help_command_lists_every_variable():
    command = Path(sys.executable).parent / "pagedserve-executor"
    out = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert [variable(action) for action in options() if variable(action) not in out] == []


@pytest.mark.parametrize("flag", ["--max-num-batched-tokens", "--max-num-seqs"])
@pytest.mark.parametrize("value", ["0", "-3", str(executor_main._MAX_STEP_LIMIT + 1)])
def test_a_step_limit_out_of_range_is_one_usage_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        executor_main.parse_config([flag, value])
    assert exited.value.code == 2
    assert (f"{flag} must be between 1 and {executor_main._MAX_STEP_LIMIT}, got {value}"
            in capsys.readouterr().err)


@pytest.mark.parametrize("value", ["0", "-0.5", "1.01", "5", "nan", "inf"])
def test_a_memory_share_out_of_range_is_one_usage_line(value, capsys):
    with pytest.raises(SystemExit) as exited:
        executor_main.parse_config(["--gpu-memory-utilization", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization must be in (0, 1]" in err and "Traceback" not in err


def test_the_memory_share_defaults_to_vllms_and_takes_the_whole_range():
    assert executor_main.parse_config([])[0].gpu_memory_utilization == 0.92
    for value in ("1", "0.05"):
        config = executor_main.parse_config(["--gpu-memory-utilization", value])[0]
        assert config.gpu_memory_utilization == float(value)


@pytest.mark.parametrize("given", ["debug", "Warning", " ERROR "])
def test_the_log_level_takes_any_case_from_the_flag_and_the_variable(given, monkeypatch):
    assert executor_main.parse_config(["--log-level", given])[2] == given.strip().upper()
    monkeypatch.setenv(f"{ENV}LOG_LEVEL", given)
    assert executor_main.parse_config([])[2] == given.strip().upper()


@pytest.mark.parametrize("env", [False, True])
def test_an_unknown_log_level_is_one_usage_line(env, monkeypatch, capsys):
    if env:
        monkeypatch.setenv(f"{ENV}LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as exited:
        executor_main.parse_config([] if env else ["--log-level", "verbose"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "'VERBOSE'" in err and "DEBUG" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,says", [
    (["--port", "99999"], "--port must be a port number, 0 to 65535, got 99999"),
    (["--port", "-1"], "--port must be a port number, 0 to 65535, got -1"),
    (["--block-size", "7"], "invalid choice: 7"),
    (["--block-size", "0"], "invalid choice: 0"),
    (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be >= 1, got 0"),
    (["--max-model-len", "-5"], "--max-model-len must be >= 1, got -5"),
    (["--swap-space", "-1"], "--swap-space must be >= 0 GiB, got -1.0"),
    (["--swap-space", "nan"], "--swap-space must be >= 0 GiB, got nan"),
    (["--swap-space", "1e12"], "--swap-space 1e+12 GiB is more than 70% of this machine's"),
    (["--hello-timeout", "inf"], "--hello-timeout must be > 0 seconds and finite, got inf"),
])
def test_a_value_out_of_its_range_is_one_usage_line(argv, says, capsys):
    """Refused before the model loads: unchecked, each would fail in torch after it, run on a
    wrapped port, or be taken as the default."""
    with pytest.raises(SystemExit) as exited:
        executor_main.parse_config(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_block_size_from_the_variable_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv(f"{ENV}BLOCK_SIZE", "12")
    with pytest.raises(SystemExit):
        executor_main.parse_config([])
    assert f"{ENV}BLOCK_SIZE=12 is not one of 8, 16, 32" in capsys.readouterr().err


def test_tls_files_are_read_before_the_model_loads(tmp_path, capsys):
    """A missing or non-PEM certificate, a key of another certificate, or one flag of the pair:
    one usage line at once (gRPC reads them only when it binds, and then blames the port)."""
    pairs = {}
    for name in ("a", "b"):
        key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        pairs[name] = str(cert), str(key)
    (tmp_path / "text.pem").write_text("not a certificate\n")
    assert executor_main.parse_config(["--tls-cert", pairs["a"][0], "--tls-key",
                                       pairs["a"][1]])[1].tls_cert == pairs["a"][0]
    for argv, says in [
            (["--tls-cert", pairs["a"][0]], "--tls-cert and --tls-key go together"),
            (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", pairs["a"][1]],
             "No such file or directory"),
            (["--tls-cert", str(tmp_path / "text.pem"), "--tls-key", pairs["a"][1]],
             "not a PEM certificate"),
            (["--tls-cert", pairs["a"][0], "--tls-key", pairs["b"][1]],
             "not a PEM certificate and its unencrypted private key")]:
        with pytest.raises(SystemExit) as exited:
            executor_main.parse_config(argv)
        assert exited.value.code == 2
        assert says in capsys.readouterr().err, argv
