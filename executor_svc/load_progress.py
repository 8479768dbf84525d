"""What the executor says while it starts: a "loading model" line naming the model and its size,
then progress until the server is ready (a status line redrawn in place on a terminal, a log line
every few seconds otherwise), then how long it took. Imports neither torch nor transformers."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TextIO

log = logging.getLogger("executor_svc")

LOG_INTERVAL_S = 5.0  # a log file: one line this often
TERMINAL_INTERVAL_S = 0.5  # a terminal: the status line redrawn this often
_MIB = 1 << 20


def model_size(source: str) -> str:
    """'94 MiB GGUF file', '2.3 GiB in 4 safetensors files', or 'random weights' (a preset)."""
    if source.startswith("preset:"):
        return "random weights"
    path = Path(source)
    if path.is_file():
        return f"{_bytes(path.stat().st_size)} GGUF file"
    files = sorted(path.glob("*.safetensors"))
    return f"{_bytes(sum(f.stat().st_size for f in files))} in {len(files)} safetensors files"


def _bytes(num_bytes: float) -> str:
    if num_bytes < 1024 * _MIB:
        return f"{num_bytes / _MIB:.0f} MiB"
    return f"{num_bytes / _MIB / 1024:.1f} GiB"


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux), to show that loading advances; else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class LoadProgress:
    """A context manager around the load: the line at entry, progress while it runs (from a
    daemon thread), the time it took at exit. `terminal`: redraw one status line on `stream`
    instead of logging a line every `interval_s`."""

    def __init__(self, name: str, size: str, where: str, stream: TextIO, terminal: bool,
                 interval_s: float | None = None) -> None:
        self.name, self.size, self.where = name, size, where
        self.stream, self.terminal = stream, terminal
        self.interval_s = interval_s or (TERMINAL_INTERVAL_S if terminal else LOG_INTERVAL_S)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._report_until_done, daemon=True,
                                        name="load-progress")
        self._started = 0.0
        self._handlers: list[logging.Handler] = []  # a terminal's: each clears the status line

    def __enter__(self) -> "LoadProgress":
        self._started = time.monotonic()
        log.info("loading model %s (%s) on %s", self.name, self.size, self.where)
        if self.terminal:
            self._handlers = [h for h in logging.getLogger().handlers
                              if getattr(h, "stream", None) is self.stream]
            for handler in self._handlers:
                handler.addFilter(self._clear_line)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._done.set()
        self._thread.join()
        for handler in self._handlers:
            handler.removeFilter(self._clear_line)
        if self.terminal:
            self._clear_line()
        if exc_type is None:
            log.info("loaded model %s in %.1fs", self.name, time.monotonic() - self._started)

    def status(self, elapsed_s: float) -> str:
        """The progress text after `elapsed_s` seconds."""
        resident = _resident_bytes()
        memory = f", {_bytes(resident)} in memory" if resident is not None else ""
        return f"loading model {self.name} ({self.size}): {elapsed_s:.0f}s{memory}"

    def _clear_line(self, _record: logging.LogRecord | None = None) -> bool:
        """Erases the status line, so that a log line (this runs as a handler's filter) starts
        on a clean line; the next redraw puts the status back under it."""
        self.stream.write("\r\x1b[K")
        return True

    def _report_until_done(self) -> None:
        while not self._done.wait(self.interval_s):
            text = self.status(time.monotonic() - self._started)
            if self.terminal:
                self.stream.write(f"\r\x1b[K{text} {_SPINNER[int(time.monotonic() * 4) % 4]}")
                self.stream.flush()
            else:
                log.info("still %s", text)


_SPINNER = "|/-\\"
