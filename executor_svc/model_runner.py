"""ModelRunner: executes StepPlans (copies, one packed forward, sampling), launched now and
finished later so step N+1 can start first; its InputBatch holds the per-seq rows, built only
from plans. Plain Python: no gRPC, no kernels.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from executor_svc.attention_metadata import build_attention_metadata, host_metadata, to_device
from executor_svc.cuda_graphs import DECODE, CudaGraphs, GrammarMask, GraphInputs
from executor_svc.device_tokens import DeviceTokens
from executor_svc.graph_sampler import StepSampling
from executor_svc.input_batch import InputBatch
from executor_svc.sampler import Sampler, SamplingTensors, copy_to_host, top_from_host
from executor_svc.step_timing import StepMarks, StepTimer
from executor_svc.structured_output import GrammarCompiler
from executor_svc.step import (
    BadSeq, CachedSeqs, ExecutorInfo, NewSeq, PlanMismatch, SampledToken, StepPlan, StepResult,
)


@dataclass(frozen=True)
class _StepBatch:
    """The seqs that compute tokens in a step, one-token seqs first: their InputBatch rows."""

    rows: np.ndarray  # [n] int64
    num_scheduled: np.ndarray  # [n] int64
    seq_ids: np.ndarray  # [n] uint64


@dataclass
class PendingStep:
    """A launched step. Its sampled ids stay on the device (`token_ids`) for the next steps'
    inputs; `results` is their host copy, valid once the step's GPU work is done."""

    step_id: int
    # The seqs that sample, in row order: their ids, rows, the rows' occupancies (InputBatch)
    # and the position each sampled token takes in its seq; [num_sampled] each
    seq_ids: np.ndarray
    rows: np.ndarray
    occupancies: np.ndarray
    positions: np.ndarray
    token_ids: torch.Tensor | None  # [num_sampled] int64 on the device
    # [2 (+ 2k), num_sampled] float64 on the host: ids, logprobs (, top ids, top logprobs)
    results: torch.Tensor | None
    kind: str  # "decode" (graph replay) or "other"
    marks: StepMarks  # marks.end: recorded after the step's GPU work; None on CPU (all done)
    forward_ms: float
    launch_ms: float
    # (index among the sampled, k) of each seq that asked for logprobs (and k top ones)
    logprobs_asked: list[tuple[int, int]] = field(default_factory=list)

    def is_ready(self) -> bool:
        """Whether finish() would return without waiting for the GPU."""
        return self.marks.end is None or self.marks.end.query()

    def wait(self) -> None:
        """Blocks until the step's GPU work is done (releases the GIL meanwhile)."""
        if self.marks.end is not None:
            self.marks.end.synchronize()


class ModelRunner:
    def __init__(self, model, backend, cache_engine, info: ExecutorInfo,
                 graphs: CudaGraphs | None = None) -> None:
        self.model = model
        self.backend = backend
        self.cache_engine = cache_engine
        self.info = info
        self.sampler = Sampler()
        self.graphs = graphs  # None: every step runs eagerly
        self.timer = StepTimer(backend.device)
        # The tokenizer a grammar needs loads on a thread from now: the first constrained seq
        # then waits for nothing.
        compiler = GrammarCompiler(info.tokenizer, info.vocab_size) if info.tokenizer else None
        self.input_batch = InputBatch(info.max_model_len, info.block_size, info.vocab_size,
                                      backend.device, grammar_compiler=compiler)
        self.last_step_id: int | None = None
        self._pending: deque[PendingStep] = deque()  # launched, not finished, in step order

    def reset(self) -> None:
        """Forget every sequence, every unfinished step and the step counter (a new Execute
        stream). GPU work already queued still runs; later steps queue behind it."""
        self.input_batch.clear()
        self.last_step_id = None
        self._pending.clear()
        self.timer.reset()

    @property
    def num_pending_steps(self) -> int:
        return len(self._pending)

    def idle(self) -> None:
        """No step in flight and none coming for a while: logs the step timing of the steps
        since its last line (the tail of a burst of work)."""
        self.timer.report_new()

    def launch(self, step: StepPlan) -> PendingStep:
        """Checks the plan, applies it and queues the step's copies, forward and sampling on the
        device, and the copy of its sampled ids to the host; waits for none of it. Raises
        PlanMismatch (changing nothing) if the plan contradicts the state."""
        start = time.perf_counter()
        cached_rows, new_token_ids = self._validate(step)
        marks = self.timer.begin()
        batch = self._apply(step, cached_rows, new_token_ids)
        forward_start = time.perf_counter()
        pending = self._run(step.step_id, batch, marks)
        pending.forward_ms = (time.perf_counter() - forward_start) * 1e3
        self.timer.end_gpu(marks)  # also what finish() waits for
        pending.launch_ms = (time.perf_counter() - start) * 1e3
        self._pending.append(pending)
        return pending

    def finish(self, pending: PendingStep) -> StepResult:
        """Waits for the oldest unfinished step, records its sampled ids in the seqs' rows and
        returns its output. Steps finish in launch order."""
        if not self._pending or self._pending[0] is not pending:
            raise RuntimeError(f"step {pending.step_id} is not the oldest unfinished step")
        start = time.perf_counter()
        pending.wait()
        self._pending.popleft()
        token_ids, logprobs = np.zeros(0, dtype=np.int64), ()
        if pending.results is not None:
            token_ids = pending.results[0].numpy().astype(np.int64)  # [num_sampled]
            self.input_batch.record_sampled(pending.rows, pending.occupancies, pending.positions,
                                            token_ids)
            logprobs = _logprobs(pending, token_ids)
        step_ms = pending.launch_ms + (time.perf_counter() - start) * 1e3
        self.timer.finish(pending.marks, pending.kind, step_ms, pending.launch_ms)
        return StepResult(pending.step_id, pending.seq_ids, token_ids, pending.forward_ms,
                          step_ms, logprobs)

    # -- validation: everything is checked before any state or cache changes ------------------

    def _validate(self, step: StepPlan) -> tuple[np.ndarray, list[np.ndarray]]:
        """Checks the plan; returns the rows of its cached seqs and each new seq's token ids
        (read once: converting a long list is not free)."""
        if self.last_step_id is not None and step.step_id != self.last_step_id + 1:
            raise PlanMismatch(f"step {step.step_id} after step {self.last_step_id}: gap or repeat")
        gpu, cpu = self.info.num_gpu_blocks, self.info.num_cpu_blocks
        _check_pairs("swap_out", step.swap_out, gpu, cpu)
        _check_pairs("swap_in", step.swap_in, cpu, gpu)
        _check_pairs("copy", step.copy, gpu, gpu)
        dropped = set(step.finished_seq_ids) | set(step.preempted_seq_ids)
        seen: set[int] = set()
        new_token_ids = []
        input_batch = self.input_batch
        for new in step.new_seqs:
            if (new.seq_id in input_batch and new.seq_id not in dropped) or new.seq_id in seen:
                raise PlanMismatch(f"new seq {new.seq_id} is already known")
            seen.add(new.seq_id)
            new_token_ids.append(self._check_new(new))
        return self._check_cached(step.cached_seqs, dropped | seen), new_token_ids

    def _check_new(self, new: NewSeq) -> np.ndarray:
        """Checks a new seq; returns its token ids from first_position on [n] int64."""
        vocab_size = self.info.vocab_size
        token_ids = np.fromiter(new.token_ids, np.int64, len(new.token_ids))  # faster than asarray
        if len(token_ids) and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
            raise BadSeq(new.seq_id, "token id out of vocabulary")
        problem = new.sampling.problem(vocab_size)
        if problem is not None:
            raise BadSeq(new.seq_id, problem)
        num_tokens = new.num_tokens
        if not 0 <= new.first_position <= new.num_computed_tokens:
            raise PlanMismatch(f"seq {new.seq_id}: first_position {new.first_position} outside "
                               f"[0, {new.num_computed_tokens}] (its computed tokens)")
        if new.first_position and new.sampling.uses_penalties:
            raise PlanMismatch(f"seq {new.seq_id}: a penalty counts every token: first_position "
                               f"must be 0")
        if new.sampling.grammar:
            self._check_grammar(new)
        num_prompt = new.num_prompt_tokens
        if num_prompt is not None and not 0 < num_prompt <= num_tokens:
            raise PlanMismatch(f"seq {new.seq_id}: num_prompt_tokens {new.num_prompt_tokens} "
                               f"outside [1, {num_tokens}]")
        if num_tokens > self.input_batch.max_num_tokens:
            raise PlanMismatch(f"seq {new.seq_id}: {num_tokens} tokens exceed max_model_len")
        self._check_counts(new.seq_id, num_tokens, new.num_computed_tokens,
                           new.num_scheduled_tokens, len(new.block_table), new.block_table)
        return token_ids

    def _check_grammar(self, new: NewSeq) -> None:
        if not self.input_batch.grammars.available:
            raise BadSeq(new.seq_id, "this executor's model has no tokenizer (or it did not "
                         "load): it cannot follow a grammar")
        if new.first_position > (new.num_prompt_tokens or new.num_tokens):
            raise PlanMismatch(f"seq {new.seq_id}: a grammar replays the generated tokens: "
                               f"first_position must be <= num_prompt_tokens")

    def _check_cached(self, cached: CachedSeqs, excluded: set[int]) -> np.ndarray:
        """Checks the plan's held seqs with whole-column ops (a seq named by `excluded` is
        dropped or new in this plan); returns their rows."""
        if not len(cached):  # a plan of new seqs only: skip the checks on empty columns
            return np.zeros(0, dtype=np.int64)
        input_batch = self.input_batch
        rows = input_batch.rows(cached.seq_ids)  # [n], -1 where unknown
        unknown = rows < 0
        if excluded:
            unknown |= np.isin(cached.seq_ids, np.array(list(excluded), dtype=np.uint64))
        if unknown.any() or (len(rows) and np.bincount(rows).max() > 1):
            seq_ids = cached.seq_ids.tolist()
            bad = (np.flatnonzero(unknown)[0] if unknown.any()
                   else next(i for i, s in enumerate(seq_ids) if s in seq_ids[:i]))
            raise PlanMismatch(f"cached seq {seq_ids[bad]} is unknown or listed twice")
        computed = input_batch.num_computed[rows]
        mismatch = np.flatnonzero(cached.num_computed_tokens != computed)
        if len(mismatch):
            i = mismatch[0]
            raise PlanMismatch(
                f"seq {cached.seq_ids[i]}: plan says {cached.num_computed_tokens[i]} computed "
                f"tokens, executor has {computed[i]}")
        # The held tables were checked when they arrived: only the appended ids are new.
        num_blocks = input_batch.block_table.lengths[rows] + cached.num_new_blocks
        end = computed + cached.num_scheduled_tokens
        bad = ((cached.num_scheduled_tokens < 0) | (end > input_batch.num_tokens[rows])
               | (end > self.info.max_model_len) | (num_blocks * self.info.block_size < end)
               | (num_blocks > input_batch.block_table.width))
        blocks = cached.new_block_ids
        bad_blocks = (blocks < 0) | (blocks >= self.info.num_gpu_blocks)
        if bad_blocks.any():
            bad[np.repeat(np.arange(len(rows)), cached.num_new_blocks)[bad_blocks]] = True
        if bad.any():  # the per-seq check says what is wrong
            i = np.flatnonzero(bad)[0]
            first = int(cached.num_new_blocks[:i].sum())
            self._check_counts(int(cached.seq_ids[i]), int(input_batch.num_tokens[rows[i]]),
                               int(computed[i]), int(cached.num_scheduled_tokens[i]),
                               int(num_blocks[i]),
                               blocks[first:first + cached.num_new_blocks[i]].tolist())
        return rows

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
        max_blocks = self.input_batch.block_table.width
        if num_blocks > max_blocks:
            raise PlanMismatch(f"seq {seq_id}: {num_blocks} blocks, more than max_model_len needs "
                               f"({max_blocks})")

    # -- state updates --------------------------------------------------------------------------

    def _apply(self, step: StepPlan, cached_rows: np.ndarray,
               new_token_ids: list[np.ndarray]) -> _StepBatch:
        """Drops, then copies queued on the device, then the seqs' diffs; returns the seqs that
        compute tokens this step. new_token_ids: the new seqs' token ids, as _validate read
        them."""
        self.last_step_id = step.step_id
        input_batch = self.input_batch
        for seq_id in (*step.finished_seq_ids, *step.preempted_seq_ids):
            input_batch.remove(seq_id)
        self.cache_engine.swap_out(step.swap_out)
        self.cache_engine.swap_in(step.swap_in)
        self.cache_engine.copy(step.copy)
        new_rows = [input_batch.add(new.seq_id, token_ids, new.block_table,
                                    new.num_computed_tokens, new.sampling, new.first_position,
                                    new.num_prompt_tokens)
                    for new, token_ids in zip(step.new_seqs, new_token_ids)]
        cached = step.cached_seqs
        input_batch.append_blocks(cached_rows, cached.num_new_blocks, cached.new_block_ids)
        rows = np.concatenate([np.array(new_rows, dtype=np.int64), cached_rows])
        num_scheduled = np.concatenate([
            np.array([new.num_scheduled_tokens for new in step.new_seqs], dtype=np.int64),
            cached.num_scheduled_tokens])
        seq_ids = np.concatenate([np.array([new.seq_id for new in step.new_seqs],
                                           dtype=np.uint64), cached.seq_ids])
        # One-token seqs first: the attention of a mixed step then runs them through the decode
        # kernel in one launch. Among them (and the rest) the longest contexts first, so the
        # decode kernel's CTAs (launched seq by seq) start the longest and its last wave is short
        # ones, not one long seq's that the rest of the GPU waits for (bench_kernels --only
        # ragged, RESULTS.md). One lexsort a step.
        order = np.lexsort((-input_batch.num_computed[rows], num_scheduled != 1))
        order = order[num_scheduled[order] > 0]
        return _StepBatch(rows[order], num_scheduled[order], seq_ids[order])

    # -- forward and sampling ---------------------------------------------------------------------

    def _run(self, step_id: int, batch: _StepBatch, marks: StepMarks) -> PendingStep:
        """One forward over the packed batch, then sampling, all queued without a host sync.
        Returns the pending step: the seqs that sampled, their token ids and logprobs (and the
        top ones when some seq asked) on the device and their host copy queued."""
        input_batch, rows = self.input_batch, batch.rows
        ends = input_batch.num_computed[rows] + batch.num_scheduled  # [n]
        # Those that catch up with their tokens sample one more.
        to_sample = np.flatnonzero(ends == input_batch.num_tokens[rows])  # [num_sampled]
        sample_rows = rows[to_sample]
        kind, logits, params, sampled = "other", None, None, None
        constrained = input_batch.grammars.constrained(sample_rows)  # [m] of to_sample
        if len(rows):
            sampling = self._step_sampling(to_sample, sample_rows)
            kind, logits, params, sampled = self._forward(batch, to_sample, sampling, constrained)
        pending = PendingStep(step_id, batch.seq_ids[to_sample], sample_rows,
                              input_batch.occupancy[sample_rows],
                              input_batch.num_tokens[sample_rows], None, None, kind, marks,
                              0.0, 0.0)
        if len(to_sample):
            if len(constrained) and sampled is None:  # a graph that samples also masked
                self._apply_grammars(logits, sample_rows[constrained], constrained)
            if sampled is None:  # not sampled in a graph: by the eager Sampler
                sampled = self._sample_eagerly(logits, params)
            token_ids, logprobs, top = sampled
            pending.token_ids, pending.results = token_ids, copy_to_host(token_ids, logprobs, top)
            pending.logprobs_asked = input_batch.logprobs_asked(sample_rows)
        input_batch.advance(rows, ends, sample_rows)
        return pending

    @torch.inference_mode()  # logits are an inference tensor
    def _apply_grammars(self, logits: torch.Tensor, rows: np.ndarray, index: np.ndarray) -> None:
        """-inf on the logits (rows `index` of logits [n, vocab]) of the tokens each row's
        grammar disallows. Called once the step's forward is queued, so the forward overlaps
        the wait in _grammar_bitmask."""
        bitmask = self._grammar_bitmask(rows)
        device = self.backend.device
        self.backend.apply_token_bitmask(logits, to_device(torch.from_numpy(bitmask), device),
                                         to_device(torch.from_numpy(index), device))

    def _awaits_unfinished(self, rows: np.ndarray) -> bool:
        """Whether a token of the seqs of InputBatch rows `rows` comes from an unfinished step."""
        input_batch = self.input_batch
        return bool((input_batch.num_known[rows] < input_batch.num_tokens[rows]).any())

    def _grammar_bitmask(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), words] int32: what the seqs of InputBatch rows `rows` may sample next. A
        token of theirs that an unfinished step sampled is waited for here (that step's end)."""
        input_batch = self.input_batch
        if self._awaits_unfinished(rows):
            self._record_unfinished()
        token_ids = input_batch.token_ids
        return input_batch.grammars.bitmask(
            rows, input_batch.num_tokens[rows],  # where the sampled tokens go
            lambda row, start, end: token_ids[row, start:end])

    def _record_unfinished(self) -> None:
        """Waits for the unfinished steps and records their sampled ids in the rows now (finish
        records them again, changing nothing)."""
        for pending in self._pending:
            if pending.results is not None:
                pending.wait()
                self.input_batch.record_sampled(
                    pending.rows, pending.occupancies, pending.positions,
                    pending.results[0].numpy().astype(np.int64))

    def _sample_eagerly(self, logits: torch.Tensor, params: SamplingTensors) -> tuple:
        """(token ids, logprobs, top ids and logprobs or None) of logits [m, vocab], and the
        penalised seqs' counts updated; all on the device."""
        token_ids, logprobs = self.sampler.sample(logits, params)
        if params.penalties is not None:  # on the device: the next step's penalties see them
            p = params.penalties
            self.input_batch.token_counts.count(p.count_rows, token_ids[p.index])
        top = (self.sampler.top_logprobs(logits, params.num_top_logprobs)
               if params.num_top_logprobs else None)
        return token_ids, logprobs, top

    def _step_sampling(self, to_sample: np.ndarray, rows: np.ndarray) -> StepSampling:
        """What the batch rows `to_sample` (seqs in `rows`) sample, the one source of a step's
        sampling parameters (a graph packs it, _sampling_tensors makes the eager Sampler's of
        it); no look at each seq's options in the common batch (all greedy, no controls)."""
        input_batch = self.input_batch
        if input_batch.all_greedy_plain(rows):
            return StepSampling(to_sample)
        return StepSampling(to_sample, input_batch.sampling_of(rows),
                            input_batch.num_tokens[rows], input_batch.count_rows_of(rows))

    def _sampling_tensors(self, sampling: StepSampling) -> SamplingTensors:
        """The eager Sampler's parameters for `sampling`."""
        if sampling.options is None:
            return SamplingTensors.for_greedy(len(sampling.rows))
        input_batch = self.input_batch
        return SamplingTensors.build(sampling.options, sampling.positions.tolist(),
                                     self.info.vocab_size, self.backend.device,
                                     input_batch.token_counts, sampling.count_rows,
                                     input_batch.num_controlled > 0)

    def _input_ids(self, batch: _StepBatch) -> tuple[np.ndarray, DeviceTokens | None]:
        """The packed input ids of the batch [num_tokens] int64. A token sampled by an unfinished
        step is a 0 here and comes from that step's sampled ids on the device (the
        DeviceTokens)."""
        input_batch = self.input_batch
        token_rows, positions = input_batch.input_positions(batch.rows, batch.num_scheduled)
        known = positions < input_batch.num_known[token_rows]  # [num_tokens]
        ids = np.where(known, input_batch.token_ids[token_rows, positions], 0).astype(np.int64)
        unknown = np.flatnonzero(~known)
        if not len(unknown):
            return ids, None
        return ids, self._device_tokens(token_rows[unknown], positions[unknown], unknown)

    def _device_tokens(self, rows: np.ndarray, positions: np.ndarray, dst_rows: np.ndarray
                       ) -> DeviceTokens:
        """Where input rows `dst_rows`, tokens at `positions` of `rows` sampled by unfinished
        steps, find their ids: each unfinished step's sampled rows are matched by row, the row's
        occupancy and position."""
        found = np.zeros(len(rows), dtype=bool)
        sampled, src, dst, offset = [], [], [], 0
        occupancies = self.input_batch.occupancy[rows]
        index = np.full(self.input_batch.capacity, -1, dtype=np.int64)  # row -> sampled index
        for p in self._pending:
            if p.token_ids is None:
                continue
            index[p.rows] = np.arange(len(p.rows))
            i = index[rows]
            hit = (i >= 0) & ~found
            hit[hit] = ((p.positions[i[hit]] == positions[hit])
                        & (p.occupancies[i[hit]] == occupancies[hit]))
            index[p.rows] = -1
            if hit.any():
                sampled.append(p.token_ids)
                src.append(offset + i[hit])
                dst.append(dst_rows[hit])
                found |= hit
                offset += len(p.rows)
        if not found.all():
            raise RuntimeError("an input token is neither on the host nor in an unfinished step")
        return DeviceTokens(sampled[0] if len(sampled) == 1 else torch.cat(sampled),
                            np.concatenate(src), np.concatenate(dst))

    def _forward_eager(self, batch: _StepBatch, tables: np.ndarray,
                       to_sample: np.ndarray) -> torch.Tensor:
        device = self.backend.device
        ids, device_tokens = self._input_ids(batch)
        input_ids = to_device(torch.from_numpy(ids), device)  # [num_tokens]
        if device_tokens is not None:
            device_tokens.scatter_into(input_ids)
        positions, metadata = build_attention_metadata(
            tables, self.input_batch.num_computed[batch.rows], batch.num_scheduled,
            self.info.block_size, device,
        )
        piecewise = self.graphs.piecewise if self.graphs is not None else None
        if piecewise is not None and piecewise.holds(len(ids)):
            hidden = piecewise.forward(input_ids, positions, metadata)
        else:
            hidden = self.model.forward(input_ids, positions, metadata,
                                        self.cache_engine.kv_caches)
        if not len(to_sample):
            return hidden[:0]
        last_rows = np.cumsum(batch.num_scheduled)[to_sample] - 1  # [num_sampled]
        return self.model.compute_logits(
            hidden[to_device(torch.from_numpy(last_rows), device)])  # [num_sampled, vocab]

    def _forward(self, batch: _StepBatch, to_sample: np.ndarray, sampling: StepSampling,
                 constrained: np.ndarray) -> tuple:
        """The step's forward, replayed from a graph where one fits, else eager. Returns (kind
        for the step timer, the logits of the rows `to_sample` [m, vocab] or None, their eager
        Sampler parameters or None, what a graph sampled (as _sample_eagerly returns) or None).
        constrained: the indices into to_sample of the rows that follow a grammar; a decode
        graph that samples them masks them first (see _grammar_mask)."""
        tables = self.input_batch.block_table.gather(batch.rows)  # [num_seqs, longest table]
        num_seqs = len(batch.rows)
        one_token = bool((batch.num_scheduled == 1).all())
        num_tokens = num_seqs if one_token else int(batch.num_scheduled.sum())
        ladder = (None if self.graphs is None else self.graphs.choose(
            num_tokens, num_seqs, tables.shape[1], one_token))
        if ladder is None:
            # Built before the forward: their host-to-device copies never wait for it.
            params = self._sampling_tensors(sampling)
            return "other", self._forward_eager(batch, tables, to_sample), params, None
        inputs = self._graph_inputs(batch, tables, to_sample, ladder == DECODE)
        mask, may_sample = None, True
        if ladder == DECODE and len(constrained):
            # The mask needs each constrained row's last token: where an unfinished step sampled
            # one, the graph's logits are masked and sampled after the forward is queued, which
            # then runs while the host waits and fills the mask; else the graph masks them.
            may_sample = (self.graphs.masks_in_graph(sampling, num_seqs)
                          and not self._awaits_unfinished(batch.rows[to_sample[constrained]]))
            if may_sample:
                mask = self._grammar_mask(batch, to_sample[constrained])
        logits, sampled = self.graphs.run(inputs, sampling, mask, may_sample)
        # After the replay is queued: the GPU needs them only after the graph, and a short
        # step's GPU would idle while they are built.
        params = self._sampling_tensors(sampling) if sampled is None else None
        return ("decode" if ladder == DECODE else "other"), logits, params, sampled

    def _grammar_mask(self, batch: _StepBatch, constrained: np.ndarray) -> GrammarMask:
        """The bitmask of a decode step's constrained seqs (`constrained`: their indices in the
        batch), for its graph to apply before sampling. Filled before the launch, so only for
        rows whose last token is known (else _apply_grammars masks after the forward is queued:
        docs/architecture.md, "Structured output")."""
        return GrammarMask(constrained, self._grammar_bitmask(batch.rows[constrained]))

    def _graph_inputs(self, batch: _StepBatch, tables: np.ndarray, to_sample: np.ndarray,
                      decode: bool) -> GraphInputs:
        """The batch's inputs for a graph: a decode step's (one token a seq, at its computed
        count) straight from the rows, a small step's through host_metadata."""
        ids, device_tokens = self._input_ids(batch)
        computed = self.input_batch.num_computed[batch.rows]  # [num_seqs]
        block_size = self.info.block_size
        if decode:
            slots = (tables[np.arange(len(computed)), computed // block_size].astype(np.int64)
                     * block_size + computed % block_size)  # [num_seqs]
            return GraphInputs(ids, computed, slots, computed + 1, tables,
                               device_tokens=device_tokens)
        positions, slots, cu_seqlens_q, seq_lens = host_metadata(
            tables, computed, batch.num_scheduled, block_size)
        last_rows = cu_seqlens_q[1:][to_sample] - 1  # [num_sampled]: their seqs' last tokens
        return GraphInputs(ids, positions, slots, seq_lens, tables, cu_seqlens_q, last_rows,
                           device_tokens)


def _logprobs(pending: PendingStep, token_ids: np.ndarray) -> tuple[SampledToken, ...]:
    """The SampledTokens, logprobs set, of the step's seqs that asked for them."""
    if not pending.logprobs_asked:
        return ()
    results = pending.results
    logprobs = results[1].tolist()
    tops = top_from_host(results) if results.shape[0] > 2 else None
    sampled = []
    for i, k in pending.logprobs_asked:
        top_ids, top_logprobs = (tops[0][i][:k], tops[1][i][:k]) if k else ((), ())
        sampled.append(SampledToken(int(pending.seq_ids[i]), int(token_ids[i]), logprobs[i],
                                    tuple(top_ids), tuple(top_logprobs)))
    return tuple(sampled)


def _check_pairs(name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise PlanMismatch(f"{name} pair ({src}, {dst}) out of range")
    if {src for src, _ in pairs} & {dst for _, dst in pairs} and name == "copy":
        raise PlanMismatch("copy: a block is both a source and a destination")
