"""One request's token state (prompt + output, num_computed_tokens, status). No page tables here:
those belong to the BlockManager. Plain Python only."""

import enum
import functools
import time

from scheduler_svc.sampling_params import SamplingParams, StoppingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.Enum):
    LENGTH = enum.auto()
    EOS = enum.auto()
    STOP_TOKEN = enum.auto()
    STOP_STRING = enum.auto()
    ABORTED = enum.auto()


@functools.lru_cache(maxsize=256)
def _stop_token_set(stop_token_ids: tuple[int, ...], eos_token_id: int | None) -> frozenset[int]:
    """Shared by the seqs that stop alike (most: EOS only), so that checking each token of a step
    reads one set that stays in cache rather than one set per seq."""
    return frozenset((*stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))))


class Sequence:
    """Token ids and progress of one request.

    `num_computed_tokens` counts tokens whose KV lies in the cache once the steps scheduled so far
    have run (it advances when a step is scheduled); `num_pending_tokens` counts tokens those steps
    will sample that have not come back yet. The scheduler moves num_computed_tokens
    towards `num_tokens`. `seed` is the request's seed, or one the scheduler assigns, so that a
    recomputed sequence samples the same tokens.
    """

    # Slots keep the attributes in the object: the scheduler reads and writes a few of them for
    # every running seq every step, faster than through a __dict__.
    __slots__ = ("seq_id", "prompt_token_ids", "sampling", "stopping", "eos_token_id",
                 "max_model_len", "arrival_time", "token_ids",
                 "num_computed_tokens", "num_pending_tokens", "status", "finish_reason",
                 "num_preemptions", "seed", "length_limit", "stop_token_set")

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingParams,
                 stopping: StoppingParams, eos_token_id: int | None, max_model_len: int,
                 arrival_time: float | None = None) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.stopping = stopping
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens a step in flight will sample for this seq, not yet known here (async scheduling).
        self.num_pending_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.seed: int | None = sampling.seed
        # Derived once for the per-step checks (the prompt and stop rules never change): the
        # num_tokens at which the seq stops by length (max_tokens, max_model_len; the scheduler
        # may stop it sooner when the GPU pool is smaller), and the token ids that may stop it
        # (the scheduler applies min_tokens and ignore_eos).
        self.length_limit = self.num_prompt_tokens + self.max_tokens
        self.stop_token_set = _stop_token_set(tuple(stopping.stop_token_ids), eos_token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        """Effective output limit: the request's max_tokens capped by the model length."""
        room = self.max_model_len - self.num_prompt_tokens
        if self.stopping.max_tokens is None:
            return room
        return min(self.stopping.max_tokens, room)

    @property
    def sort_key(self) -> tuple[float, int]:
        """Age order used by the scheduler: oldest first, ties broken by seq_id."""
        return (self.arrival_time, self.seq_id)

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})")
