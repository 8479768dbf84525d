"""Plain dataclasses of the step protocol as the executor sees it (the gRPC servicer converts
protobuf to these). Imports numpy and pagedserve_common only: nothing from protos, torch or the
rest of executor_svc.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from pagedserve_common.executor_identity import ExecutorIdentity


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # <= 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0
    # OpenAI's, on the generated tokens: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    # transformers' RepetitionPenaltyLogitsProcessor, on prompt and generated tokens
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # None: no logprobs back; k >= 0: the sampled token's logprob and the k most likely tokens'
    logprobs: int | None = None
    # llguidance grammar text the seq's tokens follow (executor_svc.structured_output); "": none
    grammar: str = ""

    @cached_property  # computed once per seq: the sampler asks every step
    def uses_penalties(self) -> bool:
        """Whether sampling needs this seq's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @cached_property
    def uses_filters(self) -> bool:
        """Whether this seq samples with top-k, top-p or min-p (a top_k at or above the
        vocabulary counts: it changes nothing, and the filtering path gives the same token)."""
        return self.temperature > 0.0 and (self.top_k > 0 or self.top_p < 1.0
                                           or self.min_p > 0.0)

    @cached_property
    def has_controls(self) -> bool:
        """Whether this seq uses a penalty, a logit bias or logprobs."""
        return self.uses_penalties or bool(self.logit_bias) or self.logprobs is not None

    def problem(self, vocab_size: int) -> str | None:
        """Why a seq cannot be sampled with these options (a value no filter or kernel takes), or
        None. The scheduler refuses such values; this keeps any other client from sending them
        into a batch."""
        values = (self.temperature, self.top_p, self.min_p, self.presence_penalty,
                  self.frequency_penalty, self.repetition_penalty, *(b for _, b in self.logit_bias))
        if not all(math.isfinite(v) for v in values):
            return "a sampling option or logit bias is not finite"
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            return (f"temperature {self.temperature}, top_p {self.top_p} or min_p {self.min_p} "
                    "out of range")
        if self.repetition_penalty <= 0:
            return f"repetition_penalty {self.repetition_penalty} is not > 0"
        if any(not 0 <= t < vocab_size for t, _ in self.logit_bias):
            return "logit_bias token id out of vocabulary"
        if self.logprobs is not None and not 0 <= self.logprobs <= vocab_size:
            return f"logprobs {self.logprobs} out of [0, {vocab_size}]"
        return None


@dataclass(frozen=True)
class NewSeq:
    """A sequence the executor has not seen (or must forget and rebuild): sent whole but for the
    tokens before `first_position`, which a cached prefix holds (never past num_computed_tokens;
    0 when the seq uses a penalty, which counts them)."""

    seq_id: int
    token_ids: list[int]  # the seq's tokens from position first_position on
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    # token_ids[:num_prompt_tokens] are the prompt, the rest were generated (presence and
    # frequency penalties count those); None: all of them are prompt
    num_prompt_tokens: int | None = None
    first_position: int = 0  # position of token_ids[0] in the seq

    @property
    def num_tokens(self) -> int:
        return self.first_position + len(self.token_ids)


# A held seq as one row: (seq_id, num_scheduled_tokens, num_computed_tokens, new_block_ids)
CachedRow = tuple[int, int, int, list[int]]


def _column(values, dtype=np.int64) -> np.ndarray:
    return np.array(values, dtype=dtype).reshape(-1)


@dataclass(frozen=True)
class CachedSeqs:
    """The plan's held seqs as a diff (tokens to compute, appended blocks), in columns: entry i of
    each column is the i-th seq; `new_block_ids` holds their appended blocks one seq after
    another, num_new_blocks[i] of them for the i-th. Columns rather than an object per seq: with
    many decoding seqs the objects alone are a large share of a step's host cost."""

    seq_ids: np.ndarray = field(default_factory=lambda: _column((), np.uint64))  # [n] uint64
    num_scheduled_tokens: np.ndarray = field(default_factory=lambda: _column(()))  # [n] int64
    num_computed_tokens: np.ndarray = field(default_factory=lambda: _column(()))  # [n] int64
    num_new_blocks: np.ndarray = field(default_factory=lambda: _column(()))  # [n] int64
    new_block_ids: np.ndarray = field(default_factory=lambda: _column(()))  # [sum] int64

    @classmethod
    def of(cls, rows: Iterable[CachedRow]) -> "CachedSeqs":
        """The columns of hand-made rows (tests, warm-up plans); the wire's are read whole."""
        seq_ids, num_scheduled, num_computed, blocks = list(zip(*rows)) or [()] * 4
        return cls(_column(seq_ids, np.uint64), _column(num_scheduled), _column(num_computed),
                   _column([len(b) for b in blocks]), _column([i for b in blocks for i in b]))

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __iter__(self) -> Iterator[CachedRow]:
        """The rows `of` takes, for readers off the hot path (tests, logs)."""
        ends = np.cumsum(self.num_new_blocks).tolist()
        for i, seq_id in enumerate(self.seq_ids.tolist()):
            blocks = self.new_block_ids[ends[i] - int(self.num_new_blocks[i]):ends[i]]
            yield (seq_id, int(self.num_scheduled_tokens[i]), int(self.num_computed_tokens[i]),
                   blocks.tolist())


@dataclass(frozen=True)
class StepPlan:
    """One step as the scheduler planned it (StepPlan on the wire and in scheduler_svc.plan)."""

    step_id: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (gpu src, gpu dst)
    new_seqs: list[NewSeq] = field(default_factory=list)
    cached_seqs: CachedSeqs = field(default_factory=CachedSeqs)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SampledToken:
    """Not frozen: one is made per sampled token, and a frozen dataclass's __init__ costs
    several times what slots do."""

    seq_id: int
    token_id: int
    # Only for a seq whose SamplingOptions.logprobs is set: the sampled token's logprob and the
    # top ones', under the model's raw distribution (log-softmax of the unmodified logits)
    logprob: float | None = None
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What one step sampled (StepResult on the wire and in scheduler_svc.plan): a token per seq
    that sampled, as two columns (no object per seq), and the logprobs of those that asked."""

    step_id: int
    seq_ids: np.ndarray  # [n] uint64: the seqs that sampled, in batch order
    token_ids: np.ndarray  # [n] int64: what each sampled
    forward_ms: float
    step_ms: float
    logprobs: tuple[SampledToken, ...] = ()  # of the seqs that asked, logprob set, in order

    @property
    def sampled(self) -> list[SampledToken]:
        """One SampledToken per seq that sampled, with its logprobs if it asked: for readers off
        the hot path (tests, tools)."""
        asked = {t.seq_id: t for t in self.logprobs}
        return [asked.get(seq_id) or SampledToken(seq_id, token_id)
                for seq_id, token_id in zip(self.seq_ids.tolist(), self.token_ids.tolist())]


class PlanMismatch(Exception):
    """The plan contradicts the executor's state (unknown seq, counter mismatch, step gap, bad
    block id, ...): maps to FAILED_PRECONDITION, after which the scheduler resyncs."""


class BadSeq(PlanMismatch):
    """A new seq's own content cannot run (a token id out of the vocabulary, a sampling option
    out of range): the plan fails naming it, and the scheduler ends its request alone rather than
    recompute it into the next plan."""

    def __init__(self, seq_id: int, problem: str) -> None:
        super().__init__(f"seq {seq_id}: {problem}")
        self.seq_ids = (seq_id,)


@dataclass(frozen=True)
class ModelGenerationConfig:
    """What serving takes from a model's generation config (Describe carries it): every EOS id,
    and the sampling defaults vLLM's --generation-config auto applies; None: the file sets none."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class StepLimits:
    """The steps the executor recommends and was sized for (Describe carries them; the rule is
    executor_svc/step_limits.py): tokens and sequences in a step, whether they bound what the
    scheduler may send (`bounded`), how they were chosen, and the captured graphs' sizes."""

    max_num_batched_tokens: int
    max_num_seqs: int
    bounded: bool
    source: str
    decode_graph_sizes: tuple[int, ...] = ()  # sequences, ascending
    small_step_graph_sizes: tuple[int, ...] = ()  # tokens, ascending


@dataclass(frozen=True)
class ExecutorInfo(ExecutorIdentity):
    generation_config: ModelGenerationConfig = ModelGenerationConfig()
    step_limits: StepLimits | None = None  # None: unset on the wire (tests' hand-made infos)
    quantization: str = ""  # the checkpoint's scheme (ModelConfig.quantization); "": dense
    kv_cache_dtype: str = ""  # the KV cache's element type ("fp8_e4m3"); "": the model's dtype
