"""SchedulerStats: what the scheduler tells the rest of the service about itself (queues, both
block pools, running counts of preemptions and swapped pages). Plain Python, no imports."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot taken by `Scheduler.stats()`; all zeros (the default) while no scheduler exists.
    The running counts run from the scheduler's creation: a fresh scheduler starts them at zero."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    gpu_blocks_used: int = 0
    gpu_blocks_total: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_total: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_blocks_swapped_out: int = 0  # pages copied to the CPU
    num_blocks_swapped_in: int = 0  # pages copied back to the GPU
    num_blocks_swap_shared_out: int = 0  # pages a swap-out found on the CPU already: not copied
    num_blocks_swap_shared_in: int = 0  # pages a swap-in found on the GPU already: not copied
    gpu_blocks_cached: int = 0  # pages in the prefix cache, referenced or free
    cpu_blocks_cached: int = 0  # CPU copies of cached pages, referenced or free
    num_prefix_cache_queries: int = 0  # tokens of seqs admitted from scratch
    num_prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache
    num_blocks_copied: int = 0  # GPU pages copied on write
