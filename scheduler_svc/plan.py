"""The step plan in domain form (what the scheduler tells the executor for one step) and the
per-sequence update the scheduler returns after a step. The wire module converts these to
protobuf; nothing here imports generated code."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from scheduler_svc.sampling_params import SamplingParams, TokenLogprobs
from scheduler_svc.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class NewSeqPlan:
    """A sequence the executor does not know: sent with its whole block table and its tokens
    (on the wire from wire.first_position on: not a cached prefix's)."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams
    seed: int
    # token_ids[:num_prompt_tokens] are the prompt (the executor's presence and frequency
    # penalties count the rest); None: all of them
    num_prompt_tokens: int | None = None


# A held seq as one row: (seq_id, num_scheduled_tokens, num_computed_tokens, new_block_ids)
CachedRow = tuple[int, int, int, list[int]]


@dataclass
class CachedSeqs:
    """The plan's sequences the executor knows, as a diff (tokens to compute, blocks appended
    since the last step), in columns: entry i of each per-seq list is the i-th sequence;
    `new_block_ids` holds their appended blocks one after another, `num_new_blocks[i]` of them
    for the i-th. Columns rather than one object per sequence (as vLLM v1's CachedRequestData):
    with many decoding sequences, an object and a message each are a large share of a step's
    host cost."""

    seq_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, rows: Iterable[CachedRow]) -> "CachedSeqs":
        """The columns of hand-made rows (tests, tools); the scheduler appends as it plans."""
        cached = cls()
        for row in rows:
            cached.append(*row)
        return cached

    def append(self, seq_id: int, num_scheduled_tokens: int, num_computed_tokens: int,
               new_block_ids: list[int]) -> None:
        self.seq_ids.append(seq_id)
        self.num_scheduled_tokens.append(num_scheduled_tokens)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_new_blocks.append(len(new_block_ids))
        self.new_block_ids.extend(new_block_ids)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __iter__(self) -> Iterator[CachedRow]:
        """The rows `of` takes, for readers off the hot path (tests, logs)."""
        start = 0
        for seq_id, num_scheduled, num_computed, num_blocks in zip(
                self.seq_ids, self.num_scheduled_tokens, self.num_computed_tokens,
                self.num_new_blocks):
            yield seq_id, num_scheduled, num_computed, self.new_block_ids[start:start + num_blocks]
            start += num_blocks


@dataclass
class StepPlan:
    """One step. Copies apply in the order swap_out, swap_in, copy, before the forward pass."""

    step_id: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (gpu src, gpu dst)
    new_seqs: list[NewSeqPlan] = field(default_factory=list)
    cached_seqs: CachedSeqs = field(default_factory=CachedSeqs)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    # Seqs whose scheduled tokens complete them, so the executor samples one token each.
    # Scheduler bookkeeping, not sent: the executor derives the same set.
    sampling_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(s.num_scheduled_tokens for s in self.new_seqs)
                + sum(self.cached_seqs.num_scheduled_tokens))

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.new_seqs) + len(self.cached_seqs)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute, copy or drop: the engine need not send it."""
        return not (self.swap_out or self.swap_in or self.copy or self.new_seqs
                    or self.cached_seqs or self.finished_seq_ids or self.preempted_seq_ids)


@dataclass(slots=True)
class SeqUpdate:
    """A token sampled for `seq` in a step; finish_reason is set when the token finished it.
    Not frozen: one is made per sampled token, and a frozen dataclass builds several times slower."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class StepResult:
    """The executor's answer to one plan: the token each sampling seq got, and the executor's
    host time for the step (building and queueing its forward pass; the whole step)."""

    sampled: dict[int, int]  # seq_id -> token id
    forward_ms: float = 0.0
    step_ms: float = 0.0
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seqs that asked only
