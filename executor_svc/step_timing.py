"""StepTimer: per step, GPU busy time against GPU idle time before it, from CUDA events on the
step stream, logged every `log_every` steps. Imports torch only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class _Totals:
    steps: int = 0
    wall_ms: float = 0.0  # GPU clock: from the previous step's end to this step's end (gap + step)
    gap_ms: float = 0.0  # GPU clock: from the previous step's end to this step's start (GPU idle)
    step_ms: float = 0.0  # host time in launch() and finish(), waiting for the GPU included
    # Host time in launch() (inputs built, work queued). A GPU with nothing else queued idles
    # through it inside [start, end], so gpu_ms counts it as busy: one step at a time, the true
    # idle share is up to (gap_ms + launch_ms) / wall_ms; overlapped, the GPU runs meanwhile.
    launch_ms: float = 0.0
    gpu_ms: float = 0.0  # GPU clock: this step's start to its end

    def line(self) -> str:
        n = max(self.steps, 1)
        wait = 1.0 - self.gpu_ms / self.wall_ms if self.wall_ms else 0.0
        return (f"steps={self.steps} wall_ms={self.wall_ms / n:.3f} gap_ms={self.gap_ms / n:.3f} "
                f"step_ms={self.step_ms / n:.3f} launch_ms={self.launch_ms / n:.3f} "
                f"gpu_ms={self.gpu_ms / n:.3f} gpu_wait_frac={wait:.3f}")


@dataclass
class StepMarks:
    """One step's events: `start` recorded when its launch begins (its plan checked), `end`
    after its last GPU work. None on CPU."""

    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None


class StepTimer:
    """Both figures come from the GPU's clock, so the share of a step during which the GPU waits
    for the host (scheduling, gRPC, input building) is known whether or not steps overlap."""

    def __init__(self, device: torch.device, log_every: int = 100) -> None:
        self.enabled = device.type == "cuda"
        self.log_every = log_every
        self.totals = {"decode": _Totals(), "other": _Totals()}
        self._last_end: torch.cuda.Event | None = None
        self._reported = 0  # steps accounted at the last report

    def begin(self) -> StepMarks:
        if not self.enabled:
            return StepMarks()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return StepMarks(start)

    def end_gpu(self, marks: StepMarks) -> None:
        """Marks the end of the step's GPU work (the device-to-host copy of its results)."""
        if self.enabled and marks.end is None:
            marks.end = torch.cuda.Event(enable_timing=True)
            marks.end.record()

    def finish(self, marks: StepMarks, kind: str, host_ms: float, launch_ms: float) -> None:
        """Accounts one step ("decode" or "other") once its GPU work is done; steps finish in
        launch order, so the previous finished step is the one before it on the stream."""
        if not self.enabled or marks.start is None:
            return
        self.end_gpu(marks)
        marks.end.synchronize()
        if self._last_end is not None:
            t = self.totals[kind]
            t.steps += 1
            t.gap_ms += self._last_end.elapsed_time(marks.start)
            t.wall_ms += self._last_end.elapsed_time(marks.end)
            t.step_ms += host_ms
            t.launch_ms += launch_ms
            t.gpu_ms += marks.start.elapsed_time(marks.end)
            if self._accounted() % self.log_every == 0:
                self.report()
        self._last_end = marks.end

    def report_new(self) -> None:
        """report(), if a step was accounted since the last report."""
        if self._reported != self._accounted():
            self.report()

    def _accounted(self) -> int:
        return sum(t.steps for t in self.totals.values())

    def report(self) -> None:
        self._reported = self._accounted()
        if self.enabled and any(t.steps for t in self.totals.values()):
            for kind, t in self.totals.items():
                log.info("step timing %s: %s", kind, t.line())
            log.info("step timing allocator: %s", allocator_line(torch.cuda.memory_stats()))

    def reset(self) -> None:
        self.report()
        self.totals = {"decode": _Totals(), "other": _Totals()}
        self._last_end = None
        self._reported = 0


def allocator_line(stats: dict) -> str:
    """The caching allocator's counts since start that can make a launch wait for the GPU: an
    allocation retried after freeing the cache (cudaFree synchronizes the device), and the
    device allocations and frees it made."""
    return (f"alloc_retries={stats.get('num_alloc_retries', 0)} "
            f"device_allocs={stats.get('num_device_alloc', 0)} "
            f"device_frees={stats.get('num_device_free', 0)}")
