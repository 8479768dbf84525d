"""ModelRunner: executes one StepPlan (copies, then one packed forward, then sampling) and keeps a
per-sequence cache rebuilt only from what plans say. A step is launched (GPU work queued, sampled
ids left on the device) and finished later (ids copied to the host), so step N+1 can be launched
before step N is finished; its input ids then come from step N's sampled ids on the device.
Decode steps replay CUDA graphs when given DecodeGraphs; others run eagerly. Plain Python: no
gRPC, no kernels.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from executor_svc.attention_metadata import build_attention_metadata, to_device
from executor_svc.block_tables import BlockTables
from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.device_tokens import DeviceTokens
from executor_svc.sampler import (Sampler, SamplingTensors, copy_to_host, from_host,
                                  top_from_host)
from executor_svc.step_timing import StepMarks, StepTimer
from executor_svc.token_counts import TokenCounts
from executor_svc.step import (
    CachedSeq, ExecutorInfo, NewSeq, PlanMismatch, SampledToken, SamplingOptions, StepPlan,
    StepResult,
)


@dataclass
class SeqState:
    token_ids: list[int]  # prompt + generated tokens known on the host
    row: int  # of the runner's BlockTables, which holds this seq's block table
    num_computed_tokens: int
    sampling: SamplingOptions
    # (step id, row) of each token sampled by a step launched but not finished, oldest first:
    # they follow token_ids, and until their step finishes they exist on the device only.
    pending: list[tuple[int, int]] = field(default_factory=list)
    count_row: int | None = None  # of the runner's TokenCounts, if the seq uses a penalty

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.pending)


@dataclass(frozen=True)
class _Scheduled:
    seq_id: int
    state: SeqState
    num_scheduled_tokens: int


@dataclass
class PendingStep:
    """A launched step. Its sampled ids stay on the device (`token_ids`) for the next steps'
    inputs; `results` is their host copy, valid once the step's GPU work is done."""

    step_id: int
    seqs: list[_Scheduled]  # the seqs that sample, in row order
    token_ids: torch.Tensor | None  # [num_sampled] int64 on the device
    # [2 (+ 2k), num_sampled] float64 on the host: ids, logprobs (, top ids, top logprobs)
    results: torch.Tensor | None
    kind: str  # "decode" (graph replay) or "other"
    marks: StepMarks  # marks.end: recorded after the step's GPU work; None on CPU (all done)
    forward_ms: float
    launch_ms: float
    maybe_logprobs: bool = False  # some seq held at launch uses a control (logprobs perhaps)

    def is_ready(self) -> bool:
        """Whether finish() would return without waiting for the GPU."""
        return self.marks.end is None or self.marks.end.query()

    def wait(self) -> None:
        """Blocks until the step's GPU work is done (releases the GIL meanwhile)."""
        if self.marks.end is not None:
            self.marks.end.synchronize()


class ModelRunner:
    def __init__(self, model, backend, cache_engine, info: ExecutorInfo,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.backend = backend
        self.cache_engine = cache_engine
        self.info = info
        self.sampler = Sampler()
        self.decode_graphs = decode_graphs  # None: every step runs eagerly
        self.timer = StepTimer(backend.device)
        self.seqs: dict[int, SeqState] = {}
        self.tables = BlockTables(-(-info.max_model_len // info.block_size))
        self.token_counts = TokenCounts(info.vocab_size, backend.device)
        self._num_controlled = 0  # held seqs using a penalty, a logit bias or logprobs
        self.last_step_id: int | None = None
        self._pending: deque[PendingStep] = deque()  # launched, not finished, in step order

    def reset(self) -> None:
        """Forget every sequence, every unfinished step and the step counter (a new Execute
        stream). GPU work already queued still runs; later steps queue behind it."""
        self.seqs.clear()
        self.tables.clear()
        self.token_counts.clear()
        self._num_controlled = 0
        self.last_step_id = None
        self._pending.clear()
        self.timer.reset()

    @property
    def num_pending_steps(self) -> int:
        return len(self._pending)

    def launch(self, step: StepPlan) -> PendingStep:
        """Checks the plan, applies it and queues the step's copies, forward and sampling on the
        device, and the copy of its sampled ids to the host; waits for none of it. Raises
        PlanMismatch (changing nothing) if the plan contradicts the state."""
        start = time.perf_counter()
        self._validate(step)
        marks = self.timer.begin()
        scheduled = self._apply(step)
        forward_start = time.perf_counter()
        seqs, sampled, kind = (self._run(step.step_id, scheduled) if scheduled
                               else ([], None, "other"))
        token_ids = sampled[0] if seqs else None
        results = copy_to_host(*sampled) if seqs else None
        forward_ms = (time.perf_counter() - forward_start) * 1e3
        self.timer.end_gpu(marks)  # also what finish() waits for
        pending = PendingStep(step.step_id, seqs, token_ids, results, kind, marks, forward_ms,
                              (time.perf_counter() - start) * 1e3, self._num_controlled > 0)
        self._pending.append(pending)
        return pending

    def finish(self, pending: PendingStep) -> StepResult:
        """Waits for the oldest unfinished step, appends its sampled ids to the host token
        lists and returns its output. Steps finish in launch order."""
        if not self._pending or self._pending[0] is not pending:
            raise RuntimeError(f"step {pending.step_id} is not the oldest unfinished step")
        start = time.perf_counter()
        pending.wait()
        self._pending.popleft()
        token_ids, logprobs = from_host(pending.results) if pending.seqs else ([], [])
        for s, token_id in zip(pending.seqs, token_ids):
            s.state.pending.pop(0)  # this step's: steps finish in order
            s.state.token_ids.append(token_id)
        sampled = _sampled_tokens(pending, token_ids, logprobs)
        step_ms = pending.launch_ms + (time.perf_counter() - start) * 1e3
        self.timer.finish(pending.marks, pending.kind, step_ms, pending.launch_ms)
        return StepResult(pending.step_id, sampled, pending.forward_ms, step_ms)

    # -- validation: everything is checked before any state or cache changes ------------------

    def _validate(self, step: StepPlan) -> None:
        if self.last_step_id is not None and step.step_id != self.last_step_id + 1:
            raise PlanMismatch(f"step {step.step_id} after step {self.last_step_id}: gap or repeat")
        gpu, cpu = self.info.num_gpu_blocks, self.info.num_cpu_blocks
        _check_pairs("swap_out", step.swap_out, gpu, cpu)
        _check_pairs("swap_in", step.swap_in, cpu, gpu)
        _check_pairs("copy", step.copy, gpu, gpu)
        dropped = set(step.finished_seq_ids) | set(step.preempted_seq_ids)
        known = self.seqs.keys() - dropped
        seen: set[int] = set()
        for new in step.new_seqs:
            if new.seq_id in known or new.seq_id in seen:
                raise PlanMismatch(f"new seq {new.seq_id} is already known")
            seen.add(new.seq_id)
            self._check_new(new)
        for cached in step.cached_seqs:
            if cached.seq_id not in known or cached.seq_id in seen:
                raise PlanMismatch(f"cached seq {cached.seq_id} is unknown or listed twice")
            seen.add(cached.seq_id)
            self._check_cached(cached, self.seqs[cached.seq_id])

    def _check_new(self, new: NewSeq) -> None:
        vocab_size = self.info.vocab_size
        if any(t < 0 or t >= vocab_size for t in new.token_ids):
            raise PlanMismatch(f"seq {new.seq_id}: token id out of vocabulary")
        if any(t < 0 or t >= vocab_size for t, _ in new.sampling.logit_bias):
            raise PlanMismatch(f"seq {new.seq_id}: logit_bias token id out of vocabulary")
        num_prompt = new.num_prompt_tokens
        if num_prompt is not None and not 0 < num_prompt <= len(new.token_ids):
            raise PlanMismatch(f"seq {new.seq_id}: num_prompt_tokens {new.num_prompt_tokens} "
                               f"outside [1, {len(new.token_ids)}]")
        self._check_counts(new.seq_id, len(new.token_ids), new.num_computed_tokens,
                           new.num_scheduled_tokens, len(new.block_table), new.block_table)

    def _check_cached(self, cached: CachedSeq, state: SeqState) -> None:
        if cached.num_computed_tokens != state.num_computed_tokens:
            raise PlanMismatch(
                f"seq {cached.seq_id}: plan says {cached.num_computed_tokens} computed tokens, "
                f"executor has {state.num_computed_tokens}"
            )
        # The held table was checked when it arrived: only the appended ids are new.
        self._check_counts(cached.seq_id, state.num_tokens, state.num_computed_tokens,
                           cached.num_scheduled_tokens,
                           self.tables.num_blocks(state.row) + len(cached.new_block_ids),
                           cached.new_block_ids)

    def _check_counts(self, seq_id: int, num_tokens: int, num_computed: int, num_scheduled: int,
                      num_blocks: int, unchecked_blocks: list[int]) -> None:
        end = num_computed + num_scheduled
        if num_computed < 0 or num_scheduled < 0 or end > num_tokens:
            raise PlanMismatch(
                f"seq {seq_id}: {num_computed} computed + {num_scheduled} scheduled "
                f"exceeds its {num_tokens} tokens"
            )
        if end > self.info.max_model_len:
            raise PlanMismatch(f"seq {seq_id}: {end} tokens exceed max_model_len")
        if any(b < 0 or b >= self.info.num_gpu_blocks for b in unchecked_blocks):
            raise PlanMismatch(f"seq {seq_id}: block id out of range [0, {self.info.num_gpu_blocks})")
        if num_blocks * self.info.block_size < end:
            raise PlanMismatch(f"seq {seq_id}: {num_blocks} blocks cannot hold {end} tokens")
        if num_blocks > self.tables.width:
            raise PlanMismatch(f"seq {seq_id}: {num_blocks} blocks, more than max_model_len needs "
                               f"({self.tables.width})")

    # -- state updates --------------------------------------------------------------------------

    def _apply(self, step: StepPlan) -> list[_Scheduled]:
        """Drops, then copies queued on the device, then the seqs' diffs; returns the seqs that
        compute tokens this step."""
        self.last_step_id = step.step_id
        for seq_id in (*step.finished_seq_ids, *step.preempted_seq_ids):
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                self.tables.free(state.row)
                if state.count_row is not None:
                    self.token_counts.free(state.count_row)
                self._num_controlled -= state.sampling.has_controls
        self.cache_engine.swap_out(step.swap_out)
        self.cache_engine.swap_in(step.swap_in)
        self.cache_engine.copy(step.copy)
        scheduled = [self._register(new) for new in step.new_seqs]
        scheduled += [self._apply_diff(cached) for cached in step.cached_seqs]
        # One-token seqs first (a stable sort keeps the plan's order otherwise): the attention
        # of a mixed step then runs them through the decode kernel in one launch.
        scheduled.sort(key=lambda s: s.num_scheduled_tokens != 1)
        return [s for s in scheduled if s.num_scheduled_tokens > 0]

    def _register(self, new: NewSeq) -> _Scheduled:
        state = SeqState(list(new.token_ids), self.tables.add(new.block_table),
                         new.num_computed_tokens, new.sampling)
        self._num_controlled += new.sampling.has_controls
        if new.sampling.uses_penalties:  # counts rebuilt from the plan's ids, prompt apart
            num_prompt = new.num_prompt_tokens or len(new.token_ids)
            state.count_row = self.token_counts.add(new.token_ids[:num_prompt],
                                                    new.token_ids[num_prompt:])
        self.seqs[new.seq_id] = state
        return _Scheduled(new.seq_id, state, new.num_scheduled_tokens)

    def _apply_diff(self, cached: CachedSeq) -> _Scheduled:
        state = self.seqs[cached.seq_id]
        if cached.new_block_ids:
            self.tables.append(state.row, cached.new_block_ids)
        return _Scheduled(cached.seq_id, state, cached.num_scheduled_tokens)

    # -- forward and sampling ---------------------------------------------------------------------

    def _run(self, step_id: int, scheduled: list[_Scheduled]
             ) -> tuple[list[_Scheduled], tuple | None, str]:
        """One forward over the packed batch, then sampling, all queued without a host sync.
        Returns the seqs that sampled; their token ids and logprobs on the device, and the top
        (ids, logprobs) when some seq asked for them; and the step kind ("decode" if
        replayed)."""
        to_sample = [i for i, s in enumerate(scheduled)
                     if s.state.num_computed_tokens + s.num_scheduled_tokens == s.state.num_tokens]
        seqs = [scheduled[i] for i in to_sample]
        # Built before the forward: their host-to-device copies are queued, never waited for.
        params = SamplingTensors.build([s.state.sampling for s in seqs],
                                       [s.state.num_tokens for s in seqs],
                                       self.info.vocab_size, self.backend.device,
                                       self.token_counts,
                                       [s.state.count_row for s in seqs] if self._num_controlled
                                       else None, self._num_controlled > 0)
        graphs = self.decode_graphs
        rows = np.fromiter((s.state.row for s in scheduled), np.int64, len(scheduled))
        tables = self.tables.gather(rows)  # [num_seqs, longest table]
        if (graphs is not None and all(s.num_scheduled_tokens == 1 for s in scheduled)
                and graphs.can_run(len(scheduled), tables.shape[1])):
            logits, kind = self._decode_replay(scheduled, tables, to_sample), "decode"
        else:
            logits, kind = self._forward_eager(scheduled, tables, to_sample), "other"
        for s in scheduled:
            s.state.num_computed_tokens += s.num_scheduled_tokens
        if not seqs:
            return [], None, kind
        token_ids, logprobs = self.sampler.sample(logits, params)
        if params.penalties is not None:  # on the device: the next step's penalties see them
            p = params.penalties
            self.token_counts.count(p.count_rows, token_ids[p.index])
        top = (self.sampler.top_logprobs(logits, params.num_top_logprobs)
               if params.num_top_logprobs else None)
        for row, s in enumerate(seqs):
            s.state.pending.append((step_id, row))
        return seqs, (token_ids, logprobs, top), kind

    def _input_ids(self, scheduled: list[_Scheduled]) -> tuple[list[int], DeviceTokens | None]:
        """The packed input ids of the batch. A token sampled by an unfinished step is a 0 here
        and comes from that step's sampled ids on the device (the DeviceTokens)."""
        ids: list[int] = []
        sources: list[tuple[torch.Tensor, int]] = []
        rows: list[int] = []
        sampled_by = {p.step_id: p.token_ids for p in self._pending}
        for s in scheduled:
            state, start = s.state, s.state.num_computed_tokens
            end, known = start + s.num_scheduled_tokens, len(s.state.token_ids)
            ids += state.token_ids[start:min(end, known)]
            for position in range(max(start, known), end):
                step_id, row = state.pending[position - known]
                sources.append((sampled_by[step_id], row))
                rows.append(len(ids))
                ids.append(0)
        return ids, DeviceTokens.collect(sources, rows)

    def _forward_eager(self, scheduled: list[_Scheduled], tables: np.ndarray,
                       to_sample: list[int]) -> torch.Tensor:
        device = self.backend.device
        ids, device_tokens = self._input_ids(scheduled)
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), device)  # [num_tokens]
        if device_tokens is not None:
            device_tokens.scatter_into(input_ids)
        positions, metadata = build_attention_metadata(
            tables,
            [s.state.num_computed_tokens for s in scheduled],
            [s.num_scheduled_tokens for s in scheduled],
            self.info.block_size, device,
        )
        hidden = self.model.forward(input_ids, positions, metadata, self.cache_engine.kv_caches)
        if not to_sample:
            return hidden[:0]
        ends = list(itertools.accumulate(s.num_scheduled_tokens for s in scheduled))
        last_rows = to_device(torch.tensor([ends[i] - 1 for i in to_sample]), device)
        return self.model.compute_logits(hidden[last_rows])  # [num_sampled, vocab]

    def _decode_replay(self, scheduled: list[_Scheduled], tables: np.ndarray,
                       to_sample: list[int]) -> torch.Tensor:
        block_size = self.info.block_size
        ids, device_tokens = self._input_ids(scheduled)
        positions = np.fromiter((s.state.num_computed_tokens for s in scheduled), np.int64,
                                len(scheduled))  # [num_seqs]
        slots = (tables[np.arange(len(scheduled)), positions // block_size].astype(np.int64)
                 * block_size + positions % block_size)  # [num_seqs]
        logits = self.decode_graphs.run(ids, positions, slots, tables,
                                        device_tokens)  # [num_seqs, vocab]
        if len(to_sample) == len(scheduled):
            return logits
        return logits[to_device(torch.tensor(to_sample), self.backend.device)]


def _sampled_tokens(pending: PendingStep, token_ids: list[int], logprobs: list[float]
                    ) -> list[SampledToken]:
    """The step's SampledTokens; logprobs only for the seqs that asked."""
    if not pending.maybe_logprobs:  # the common step: no per-seq look at the options
        return [SampledToken(s.seq_id, t) for s, t in zip(pending.seqs, token_ids)]
    tops = (top_from_host(pending.results) if pending.seqs and pending.results.shape[0] > 2
            else None)
    sampled = []
    for i, (s, token_id) in enumerate(zip(pending.seqs, token_ids)):
        k = s.state.sampling.logprobs
        if k is None:
            sampled.append(SampledToken(s.seq_id, token_id))
        else:
            top_ids, top_logprobs = (tops[0][i][:k], tops[1][i][:k]) if k else ((), ())
            sampled.append(SampledToken(s.seq_id, token_id, logprobs[i], tuple(top_ids),
                                        tuple(top_logprobs)))
    return sampled


def _check_pairs(name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise PlanMismatch(f"{name} pair ({src}, {dst}) out of range")
    if {src for src, _ in pairs} & {dst for _, dst in pairs} and name == "copy":
        raise PlanMismatch("copy: a block is both a source and a destination")
