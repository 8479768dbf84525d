"""StepTimer: how long the GPU works in each step against the wall time between step starts, so
the share of a step during which the GPU waits for the host (scheduling, gRPC, input building) is
known. Logs cumulative figures every `log_every` steps and at reset. Imports torch only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class _Totals:
    steps: int = 0
    wall_ms: float = 0.0  # from the previous step's end to this step's end (gap + step)
    gap_ms: float = 0.0  # from the previous step's end to this step's start (executor idle)
    step_ms: float = 0.0  # execute() on the host, sync included
    gpu_ms: float = 0.0  # first to last GPU event of the step

    def line(self) -> str:
        n = max(self.steps, 1)
        wait = 1.0 - self.gpu_ms / self.wall_ms if self.wall_ms else 0.0
        return (f"steps={self.steps} wall_ms={self.wall_ms / n:.3f} gap_ms={self.gap_ms / n:.3f} "
                f"step_ms={self.step_ms / n:.3f} gpu_ms={self.gpu_ms / n:.3f} "
                f"gpu_wait_frac={wait:.3f}")


class StepTimer:
    def __init__(self, device: torch.device, log_every: int = 100) -> None:
        self.enabled = device.type == "cuda"
        self.log_every = log_every
        self.totals = {"decode": _Totals(), "other": _Totals()}
        self._last_end: float | None = None
        self._events: tuple | None = None
        self._ended = False

    def begin(self) -> float:
        if self.enabled:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, torch.cuda.Event(enable_timing=True))
            self._ended = False
        return time.perf_counter()

    def end_gpu(self) -> None:
        """Marks the end of the step's GPU work (call before the step's one host sync)."""
        if self._events is not None and not self._ended:
            self._events[1].record()
            self._ended = True

    def finish(self, kind: str, started: float) -> float:
        """Accounts one step ("decode" or "other") after its host sync; returns step ms."""
        if self._events is not None and not self._ended:  # a step that sampled nothing
            self.end_gpu()
            self._events[1].synchronize()
        now = time.perf_counter()
        step_ms = (now - started) * 1e3
        if self.enabled and self._events is not None and self._last_end is not None:
            t = self.totals[kind]
            t.steps += 1
            t.gap_ms += (started - self._last_end) * 1e3
            t.wall_ms += (now - self._last_end) * 1e3
            t.step_ms += step_ms
            t.gpu_ms += self._events[0].elapsed_time(self._events[1])
            if sum(x.steps for x in self.totals.values()) % self.log_every == 0:
                self.report()
        self._last_end = now
        self._events = None
        return step_ms

    def report(self) -> None:
        if self.enabled and any(t.steps for t in self.totals.values()):
            for kind, t in self.totals.items():
                log.info("step timing %s: %s", kind, t.line())

    def reset(self) -> None:
        self.report()
        self.totals = {"decode": _Totals(), "other": _Totals()}
        self._last_end = None
