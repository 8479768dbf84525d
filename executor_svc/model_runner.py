"""ModelRunner: executes one Step (copies, then one packed forward, then sampling) and keeps a
per-sequence cache rebuilt only from what plans say. Plain Python: no gRPC, no kernels.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.sampler import Sampler
from executor_svc.step import (
    CachedSeq, ExecutorInfo, NewSeq, PlanMismatch, SampledToken, SamplingOptions, Step, StepOutput,
)


@dataclass
class SeqState:
    token_ids: list[int]  # prompt + generated, including tokens this executor sampled
    block_table: list[int]
    num_computed_tokens: int
    sampling: SamplingOptions


@dataclass(frozen=True)
class _Scheduled:
    seq_id: int
    state: SeqState
    num_scheduled_tokens: int


class ModelRunner:
    def __init__(self, model, backend, cache_engine, info: ExecutorInfo) -> None:
        self.model = model
        self.backend = backend
        self.cache_engine = cache_engine
        self.info = info
        self.sampler = Sampler()
        self.seqs: dict[int, SeqState] = {}
        self.last_step_id: int | None = None

    def reset(self) -> None:
        """Forget every sequence and the step counter (a new Execute stream)."""
        self.seqs.clear()
        self.last_step_id = None

    def execute(self, step: Step) -> StepOutput:
        start = time.perf_counter()
        self._validate(step)
        self.last_step_id = step.step_id
        for seq_id in (*step.finished_seq_ids, *step.preempted_seq_ids):
            self.seqs.pop(seq_id, None)
        self.cache_engine.swap_out(step.swap_out)
        self.cache_engine.swap_in(step.swap_in)
        self.cache_engine.copy(step.copy)
        scheduled = [self._register(new) for new in step.new_seqs]
        scheduled += [self._apply_diff(cached) for cached in step.cached_seqs]
        scheduled = [s for s in scheduled if s.num_scheduled_tokens > 0]
        forward_start = time.perf_counter()
        sampled = self._run(scheduled) if scheduled else []
        forward_ms = (time.perf_counter() - forward_start) * 1e3
        return StepOutput(step.step_id, sampled, forward_ms, (time.perf_counter() - start) * 1e3)

    # -- validation: everything is checked before any state or cache changes ------------------

    def _validate(self, step: Step) -> None:
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
        if any(t < 0 or t >= self.info.vocab_size for t in new.token_ids):
            raise PlanMismatch(f"seq {new.seq_id}: token id out of vocabulary")
        self._check_counts(new.seq_id, len(new.token_ids), new.num_computed_tokens,
                           new.num_scheduled_tokens, new.block_table)

    def _check_cached(self, cached: CachedSeq, state: SeqState) -> None:
        if cached.num_computed_tokens != state.num_computed_tokens:
            raise PlanMismatch(
                f"seq {cached.seq_id}: plan says {cached.num_computed_tokens} computed tokens, "
                f"executor has {state.num_computed_tokens}"
            )
        self._check_counts(cached.seq_id, len(state.token_ids), state.num_computed_tokens,
                           cached.num_scheduled_tokens, state.block_table + cached.new_block_ids)

    def _check_counts(self, seq_id: int, num_tokens: int, num_computed: int, num_scheduled: int,
                      block_table: list[int]) -> None:
        end = num_computed + num_scheduled
        if num_computed < 0 or num_scheduled < 0 or end > num_tokens:
            raise PlanMismatch(
                f"seq {seq_id}: {num_computed} computed + {num_scheduled} scheduled "
                f"exceeds its {num_tokens} tokens"
            )
        if end > self.info.max_model_len:
            raise PlanMismatch(f"seq {seq_id}: {end} tokens exceed max_model_len")
        if any(b < 0 or b >= self.info.num_gpu_blocks for b in block_table):
            raise PlanMismatch(f"seq {seq_id}: block id out of range [0, {self.info.num_gpu_blocks})")
        if len(block_table) * self.info.block_size < end:
            raise PlanMismatch(f"seq {seq_id}: {len(block_table)} blocks cannot hold {end} tokens")

    # -- state updates --------------------------------------------------------------------------

    def _register(self, new: NewSeq) -> _Scheduled:
        state = SeqState(list(new.token_ids), list(new.block_table), new.num_computed_tokens,
                         new.sampling)
        self.seqs[new.seq_id] = state
        return _Scheduled(new.seq_id, state, new.num_scheduled_tokens)

    def _apply_diff(self, cached: CachedSeq) -> _Scheduled:
        state = self.seqs[cached.seq_id]
        state.block_table.extend(cached.new_block_ids)
        return _Scheduled(cached.seq_id, state, cached.num_scheduled_tokens)

    # -- forward and sampling ---------------------------------------------------------------------

    def _run(self, scheduled: list[_Scheduled]) -> list[SampledToken]:
        device = self.backend.device
        input_ids = torch.tensor([
            t for s in scheduled
            for t in s.state.token_ids[s.state.num_computed_tokens:
                                       s.state.num_computed_tokens + s.num_scheduled_tokens]
        ], dtype=torch.int64, device=device)  # [num_tokens]
        positions, metadata = build_attention_metadata(
            [s.state.block_table for s in scheduled],
            [s.state.num_computed_tokens for s in scheduled],
            [s.num_scheduled_tokens for s in scheduled],
            self.info.block_size, device,
        )
        hidden = self.model.forward(input_ids, positions, metadata, self.cache_engine.kv_caches)
        for s in scheduled:
            s.state.num_computed_tokens += s.num_scheduled_tokens
        to_sample = [i for i, s in enumerate(scheduled)
                     if s.state.num_computed_tokens == len(s.state.token_ids)]
        if not to_sample:
            return []
        last_rows = (metadata.cu_seqlens_q[1:].long() - 1)[to_sample]  # each seq's last query row
        logits = self.model.compute_logits(hidden[last_rows])  # [num_sampled, vocab]
        seqs = [scheduled[i] for i in to_sample]
        token_ids, logprobs = self.sampler(
            logits, [s.state.sampling for s in seqs], [len(s.state.token_ids) for s in seqs]
        )
        for s, token_id in zip(seqs, token_ids):
            s.state.token_ids.append(token_id)
        return [SampledToken(s.seq_id, t, lp) for s, t, lp in zip(seqs, token_ids, logprobs)]


def _check_pairs(name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise PlanMismatch(f"{name} pair ({src}, {dst}) out of range")
    if {src for src, _ in pairs} & {dst for _, dst in pairs} and name == "copy":
        raise PlanMismatch("copy: a block is both a source and a destination")
