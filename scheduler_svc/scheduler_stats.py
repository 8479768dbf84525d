"""SchedulerStats: what the scheduler tells the rest of the service about itself (queues, both
block pools, running counts of preemptions and swapped pages). Plain Python, no imports."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot taken by `Scheduler.stats()`; all zeros (the default) while no scheduler exists.
    The four counts run from the scheduler's creation: a fresh scheduler starts them at zero."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    gpu_blocks_used: int = 0
    gpu_blocks_total: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_total: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
