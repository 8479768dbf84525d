"""Runs the executor and the scheduler together for `make serve`. Ctrl-C or SIGTERM drains the
scheduler first (admission stops, running requests finish or reach its --shutdown-timeout), then
stops the executor. Imports neither service: it only runs them.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading

from pagedserve_common.interrupt import SIGNAL_POLL_S

_PROG = "pagedserve-serve"
_PR_SET_PDEATHSIG = 1
_EXECUTOR_READY = "executor ready on"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__)
    p.add_argument("--executor-args", default="", help="flags of pagedserve-executor (one string)")
    p.add_argument("--scheduler-args", default="", help="flags of pagedserve-scheduler (one string)")
    a = p.parse_args(argv)
    return Launcher(shlex.split(a.executor_args), shlex.split(a.scheduler_args)).run()


class Launcher:
    """The two child processes, each in a process group of its own: a terminal's Ctrl-C reaches
    only this process, which decides who stops when."""

    def __init__(self, executor_args: list[str], scheduler_args: list[str]) -> None:
        self._executor_cmd = [sys.executable, "-m", "executor_svc.main", *executor_args]
        self._scheduler_cmd = [sys.executable, "-m", "scheduler_svc.main", *scheduler_args]
        self._stopping = threading.Event()  # set by the first Ctrl-C / SIGTERM
        self._exited = threading.Condition()  # notified when a child exits or a signal comes
        self._executor_ready = False
        self._executor_last_line = ""

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.executor = _spawn(self._executor_cmd, stdout=subprocess.PIPE)
        self.scheduler = _spawn(self._scheduler_cmd, stdout=None)
        threading.Thread(target=self._relay_executor, daemon=True).start()
        for proc in (self.executor, self.scheduler):
            threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        with self._exited:  # timed waits: the signal handler runs however it was delivered
            while not self._exited.wait_for(self._should_stop, timeout=SIGNAL_POLL_S):
                pass
        return self._stop()

    def _should_stop(self) -> bool:
        return (self._stopping.is_set() or self.executor.poll() is not None
                or self.scheduler.poll() is not None)

    def _stop(self) -> int:
        """The scheduler first (it drains), then the executor. Exit status: 0 after a signal
        when both stopped cleanly; else non-zero, the executor's own if it ended first."""
        executor_first = self.executor.poll() is not None and not self._stopping.is_set()
        if executor_first:
            stage = "running" if self._executor_ready else "starting"
            _say(f"the executor exited while {stage} (status {self.executor.returncode}): "
                 f"{self._executor_last_line or 'no output'}; stopping the scheduler")
        scheduler_code = _terminate(self.scheduler)
        _say(f"scheduler exited (status {scheduler_code}); stopping the executor")
        executor_code = _terminate(self.executor)
        _say(f"executor exited (status {executor_code})")
        if executor_first:
            return executor_code if executor_code > 0 else 1
        if self._stopping.is_set():
            return 0 if scheduler_code == executor_code == 0 else 1
        return scheduler_code if scheduler_code > 0 else 1

    def _on_signal(self, signum, _frame) -> None:
        if self._stopping.is_set():  # a second Ctrl-C: stop at once
            _say("second signal: killing both services")
            for proc in (self.scheduler, self.executor):
                if proc.poll() is None:
                    proc.kill()
            return
        _say(f"{signal.Signals(signum).name}: draining the scheduler, then stopping the executor "
             "(again to stop at once)")
        self._stopping.set()
        threading.Thread(target=self._notify, daemon=True).start()  # no lock in a handler

    def _notify(self) -> None:
        with self._exited:
            self._exited.notify_all()

    def _watch(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self._notify()

    def _relay_executor(self) -> None:
        """Copies the executor's output to stderr, remembering its last line and readiness."""
        for raw in self.executor.stdout:
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.strip():
                self._executor_last_line = line.strip()
            if _EXECUTOR_READY in line:
                self._executor_ready = True


def _spawn(cmd: list[str], stdout) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                            preexec_fn=_own_group_and_die_with_parent)


def _own_group_and_die_with_parent() -> None:
    """In the child before exec: a process group of its own (the terminal's Ctrl-C is ours to
    forward), and SIGTERM if this launcher dies without stopping it (Linux)."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _terminate(proc: subprocess.Popen) -> int:
    """SIGTERM, then wait as long as it takes: the scheduler's own --shutdown-timeout bounds its
    drain, and a second Ctrl-C kills. A child that SIGTERM ended before it installed its handler
    (still starting) counts as a clean stop."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        while True:  # timed waits: a second Ctrl-C's handler runs meanwhile
            try:
                return 0 if proc.wait(timeout=SIGNAL_POLL_S) == -signal.SIGTERM else \
                    proc.returncode
            except subprocess.TimeoutExpired:
                pass
    return proc.returncode


def _say(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
