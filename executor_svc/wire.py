"""Conversions between the Executor protobuf messages and executor_svc.step's dataclasses."""
from __future__ import annotations

from protos import executor_pb2
from executor_svc.step import (CachedSeq, ExecutorInfo, NewSeq, PlanMismatch, SamplingOptions,
                               StepPlan, StepResult)


def _pairs(pairs) -> list[tuple[int, int]]:
    return [(p.src, p.dst) for p in pairs]


def _sampling(s: executor_pb2.SamplingOptions) -> SamplingOptions:
    if len(s.logit_bias_token_ids) != len(s.logit_bias_values):
        raise PlanMismatch("sampling: logit_bias_token_ids and logit_bias_values differ in length")
    return SamplingOptions(
        temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        logit_bias=tuple(zip(s.logit_bias_token_ids, s.logit_bias_values)),
        logprobs=s.logprobs if s.HasField("logprobs") else None)


def plan_from_proto(plan: executor_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=plan.step_id,
        swap_out=_pairs(plan.swap_out),
        swap_in=_pairs(plan.swap_in),
        copy=_pairs(plan.copy),
        new_seqs=[
            NewSeq(seq_id=s.seq_id, token_ids=list(s.token_ids), block_table=list(s.block_table),
                   num_computed_tokens=s.num_computed_tokens,
                   num_scheduled_tokens=s.num_scheduled_tokens, sampling=_sampling(s.sampling),
                   num_prompt_tokens=s.num_prompt_tokens or None)
            for s in plan.new_seqs
        ],
        cached_seqs=[
            *(CachedSeq(seq_id=s.seq_id, num_scheduled_tokens=s.num_scheduled_tokens,
                        num_computed_tokens=s.num_computed_tokens,
                        new_block_ids=list(s.new_block_ids))
              for s in plan.cached_seqs),
            *_cached_columns(plan.cached),
        ],
        finished_seq_ids=list(plan.finished_seq_ids),
        preempted_seq_ids=list(plan.preempted_seq_ids),
    )


def _cached_columns(cached: executor_pb2.CachedSeqs) -> list[CachedSeq]:
    """The columns of CachedSeqs, row by row; PlanMismatch if they do not line up."""
    num_seqs = len(cached.seq_ids)
    block_ids = list(cached.new_block_ids)
    num_new_blocks = list(cached.num_new_blocks)
    if not (len(cached.num_scheduled_tokens) == len(cached.num_computed_tokens)
            == len(num_new_blocks) == num_seqs) or sum(num_new_blocks) != len(block_ids):
        raise PlanMismatch("cached: columns of different lengths, or num_new_blocks does not "
                           "add up to new_block_ids")
    seqs, start = [], 0
    for seq_id, num_scheduled, num_computed, num_blocks in zip(
            cached.seq_ids, cached.num_scheduled_tokens, cached.num_computed_tokens,
            num_new_blocks):
        seqs.append(CachedSeq(seq_id=seq_id, num_scheduled_tokens=num_scheduled,
                              num_computed_tokens=num_computed,
                              new_block_ids=block_ids[start:start + num_blocks]))
        start += num_blocks
    return seqs


def result_to_proto(result: StepResult) -> executor_pb2.StepResult:
    return executor_pb2.StepResult(
        step_id=result.step_id,
        sampled=[executor_pb2.SampledToken(seq_id=t.seq_id, token_id=t.token_id)
                 for t in result.sampled],
        logprobs=[executor_pb2.SampledLogprobs(seq_id=t.seq_id, logprob=t.logprob,
                                               top_token_ids=t.top_token_ids,
                                               top_logprobs=t.top_logprobs)
                  for t in result.sampled if t.logprob is not None],
        forward_ms=result.forward_ms,
        step_ms=result.step_ms,
    )


def info_to_proto(info: ExecutorInfo, instance_id: int) -> executor_pb2.DescribeResponse:
    return executor_pb2.DescribeResponse(
        model_name=info.model_name,
        fingerprint=info.fingerprint,
        dtype=info.dtype,
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        tokenizer=info.tokenizer,
        backend=info.backend,
        instance_id=instance_id,
    )
