"""Ctrl-C (SIGINT) on a standalone executor, a real process: while the model loads it exits 130
with one line, once ready it stops serving and exits 0; never a traceback. A scheduler interrupted
while it starts exits 130 with one line too.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.integration.harness import (default_sigint, free_port, signal_another_thread,
                                       start_lone_executor)

pytestmark = pytest.mark.slow


def interrupted(model: str, when: str) -> tuple[int, list[str]]:
    """Starts an executor, sends SIGINT once a line containing `when` is out; (exit status, the
    lines from that one on)."""
    # faulthandler: an executor that outlives the signal is aborted with every thread's stack
    # in its output, so a hang says where it hung.
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "executor_svc.main",
                             "--backend", "cpu", "--model", model, "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_sigint)
    try:
        for line in proc.stdout:
            if when in line:
                proc.send_signal(signal.SIGINT)
                break
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            rest, _ = proc.communicate(timeout=30)
            pytest.fail(f"still running 60 s after SIGINT; its stacks:\n{rest[-6000:]}")
    finally:
        proc.kill()
    return proc.returncode, [line, *rest.splitlines()]


def test_ctrl_c_while_loading_exits_130_with_one_line():
    # random weights of this size take seconds to build: the signal lands mid-load
    code, lines = interrupted("preset:smollm2-135m", "loading model")
    assert code == 130
    said = [line for line in lines[1:] if line.strip()]
    assert said == ["pagedserve-executor: interrupted (SIGINT) before serving; nothing was "
                    "started"], lines


# A start whose library would turn a KeyboardInterrupt into its own error (as a class body's
# __set_name__ does on Python 3.11: RuntimeError) or swallow it and go on: the real main, its
# start replaced by one that is interrupted inside such a library call.
_LIBRARY_CATCHES_IT = """
import os, signal, sys

def library_call():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):  # a handler runs between two bytecodes
            pass
    except KeyboardInterrupt as err:
        if sys.argv[1] == "wraps":
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from err

def start(config, transport):
    library_call()
    return None, 0, None

async def serve(config):
    library_call()

if sys.argv[2] == "executor":
    from executor_svc import main
    main._start = start
    main.main(["--backend", "cpu", "--port", sys.argv[3]])
else:
    from scheduler_svc import main
    main.serve = serve
    main.main(["--port", sys.argv[3]])
"""


@pytest.mark.parametrize("library", ["wraps", "swallows"])
@pytest.mark.parametrize("service", ["executor", "scheduler"])
def test_ctrl_c_inside_a_library_call_while_starting_exits_130(service, library):
    proc = subprocess.run([sys.executable, "-c", _LIBRARY_CATCHES_IT, library, service,
                           str(free_port())],
                          capture_output=True, text=True, timeout=60, preexec_fn=default_sigint)
    assert proc.returncode == 130, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"pagedserve-{service}: interrupted (SIGINT) before serving; nothing was started"]


def test_ctrl_c_once_ready_stops_and_exits_0():
    code, lines = interrupted("preset:tiny", "executor ready")
    assert code == 0
    assert "Traceback" not in "\n".join(lines)
    assert len(lines) == 2 and lines[1].endswith("SIGINT: stopping (open streams get 2 s)"), lines


def test_sigterm_taken_by_another_thread_still_stops_a_ready_executor(tmp_path):
    """The kernel hands a process's signal to any of its threads; with one of gRPC's taking it
    the executor must still stop, or docker stop ends in SIGKILL."""
    executor = start_lone_executor(tmp_path, ["--model", "preset:tiny"])
    try:
        signal_another_thread(executor.proc.pid, signal.SIGTERM)
        assert executor.proc.wait(timeout=15) == 0
        with open(executor.log) as f:
            assert "SIGTERM: stopping" in f.read()
    finally:
        executor.proc.kill()
