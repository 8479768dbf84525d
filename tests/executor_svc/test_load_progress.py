"""The executor's loading line and progress: the model's size, a log line every interval in a log
file, a status line redrawn in place on a terminal that log lines do not tear apart."""
from __future__ import annotations

import io
import logging
import re
import threading

import pytest

from executor_svc.load_progress import LoadProgress, model_size


def test_model_size_of_each_source_kind(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * (3 << 20))
    assert model_size(str(gguf)) == "3 MiB GGUF file"
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        with open(folder / name, "wb") as f:
            f.truncate(768 << 20)  # sparse: no disk used
    assert model_size(str(folder)) == "1.5 GiB in 2 safetensors files"
    assert model_size("preset:tiny") == "random weights"


class _Seen(logging.Handler):
    """Collects messages; `event` is set once one contains `wanted`."""

    def __init__(self, wanted: str) -> None:
        super().__init__()
        self.wanted, self.messages, self.event = wanted, [], threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.wanted in self.messages[-1]:
            self.event.set()


@pytest.fixture
def seen():
    handler = _Seen("still loading model")
    logger = logging.getLogger("executor_svc")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_log_file_gets_the_loading_line_then_a_line_every_interval(seen):
    stream = io.StringIO()
    with LoadProgress("m", "3 MiB GGUF file", "cpu, float32", stream, terminal=False,
                      interval_s=0.01):
        assert seen.event.wait(30)
    first, still, last = seen.messages[0], seen.messages[1], seen.messages[-1]
    assert first == "loading model m (3 MiB GGUF file) on cpu, float32"
    assert still.startswith("still loading model m (3 MiB GGUF file): 0s")
    assert last.startswith("loaded model m in ")
    assert stream.getvalue() == ""  # nothing drawn: a log file gets lines only


class _Terminal(io.StringIO):
    """A stream that says when a status line was drawn on it."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = threading.Event()

    def write(self, text: str) -> int:
        if "loading model" in text and text.startswith("\r\x1b[K"):
            self.drawn.set()
        return super().write(text)


def test_a_terminal_gets_a_status_line_that_log_lines_clear_first():
    terminal = _Terminal()
    handler = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(handler)
    logger = logging.getLogger("executor_svc")
    level, logger.level = logger.level, logging.INFO
    try:
        with LoadProgress("m", "random weights", "cpu, float32", terminal, terminal=True,
                          interval_s=0.01):
            assert terminal.drawn.wait(30)
            logging.getLogger("executor_svc.worker").info("a line while loading")
    finally:
        root.removeHandler(handler)
        logger.setLevel(level)
    shown = terminal.getvalue()
    assert shown.startswith("loading model m (random weights) on cpu, float32\n")
    assert "\r\x1b[Kloading model m (random weights): 0s" in shown
    assert "\r\x1b[Ka line while loading\n" in shown  # the status line erased before it
    # at the end the line is cleared once (the filter is gone), then the time the load took
    assert re.search(r"[^K]\r\x1b\[Kloaded model m in [0-9.]+s\n$", shown), repr(shown[-200:])
