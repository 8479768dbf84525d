"""The step plan in domain form (what the scheduler tells the executor for one step) and the
per-sequence update the scheduler returns after a step. The wire module converts these to
protobuf; nothing here imports generated code."""

from dataclasses import dataclass, field

from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class NewSeqPlan:
    """A sequence the executor does not know: sent in full with its whole block table."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams
    seed: int


@dataclass(frozen=True)
class CachedSeqPlan:
    """A sequence the executor knows: only the diff (blocks appended since the last step)."""

    seq_id: int
    num_scheduled_tokens: int
    num_computed_tokens: int
    new_block_ids: list[int]


@dataclass
class StepPlan:
    """One step. Copies apply in the order swap_out, swap_in, copy, before the forward pass."""

    step_id: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (gpu src, gpu dst)
    new_seqs: list[NewSeqPlan] = field(default_factory=list)
    cached_seqs: list[CachedSeqPlan] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Seqs whose scheduled tokens complete them, so the executor samples one token each.
    # Scheduler bookkeeping, not sent: the executor derives the same set.
    sampling_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(s.num_scheduled_tokens for s in self.new_seqs)
                + sum(s.num_scheduled_tokens for s in self.cached_seqs))

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.new_seqs) + len(self.cached_seqs)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute, copy or drop: the engine need not send it."""
        return not (self.swap_out or self.swap_in or self.copy or self.new_seqs
                    or self.cached_seqs or self.finished_seq_ids or self.preempted_seq_ids)


@dataclass(frozen=True)
class SeqUpdate:
    """A token sampled for `seq` in a step; finish_reason is set when the token finished it."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None
