"""Scheduling policy knobs (token budget, batch size, chunked prefill, preemption mode).

Service-level flags (ports, queue sizes, grace periods) live elsewhere; this is policy only.
"""

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True)
class SchedulerConfig:
    """`preemption_mode="swap"` swaps while the CPU pool has room, else recomputes;
    `"recompute"` always recomputes."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    preemption_mode: str = "swap"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
