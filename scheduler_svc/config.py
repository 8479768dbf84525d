"""Scheduling policy knobs (token budget, batch size, chunked prefill, preemption mode).

Service-level flags (ports, queue sizes, grace periods) live elsewhere; this is policy only.
"""

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True)
class SchedulerConfig:
    """`preemption_mode="swap"` swaps while the CPU pool has room, else recomputes;
    `"recompute"` always recomputes. `enable_prefix_caching`: a new sequence starts from the
    cached full pages of its longest cached prefix (the block manager's prefix cache)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    preemption_mode: str = "swap"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
