"""Conversions between the Executor protobuf messages and executor_svc.step's dataclasses. The
per-seq columns of a plan and of a result cross whole (packed fields, numpy arrays), never as an
object per seq."""
from __future__ import annotations

import numpy as np

from pagedserve_common.executor_identity import identity_fields
from protos import executor_pb2
from executor_svc.step import (CachedSeqs, ExecutorInfo, ModelGenerationConfig, NewSeq,
                               PlanMismatch, SampledToken, SamplingOptions, StepLimits, StepPlan,
                               StepResult)


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
        logprobs=s.logprobs if s.HasField("logprobs") else None, grammar=s.grammar)


def plan_from_proto(plan: executor_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=plan.step_id,
        swap_out=_pairs(plan.swap_out),
        swap_in=_pairs(plan.swap_in),
        copy=_pairs(plan.copy),
        new_seqs=[
            NewSeq(seq_id=s.seq_id, token_ids=_ints(s.token_ids), block_table=list(s.block_table),
                   num_computed_tokens=s.num_computed_tokens,
                   num_scheduled_tokens=s.num_scheduled_tokens, sampling=_sampling(s.sampling),
                   num_prompt_tokens=s.num_prompt_tokens or None,
                   first_position=s.first_position)
            for s in plan.new_seqs
        ],
        cached_seqs=_cached_columns(plan.cached),
        finished_seq_ids=list(plan.finished_seq_ids),
        preempted_seq_ids=list(plan.preempted_seq_ids),
    )


def _ints(values) -> list[int]:
    """A repeated integer field as a list: read through numpy (upb hands it over as one buffer),
    faster than list() for long fields."""
    return np.asarray(values).tolist()


def _cached_columns(cached: executor_pb2.CachedSeqs) -> CachedSeqs:
    """The columns of CachedSeqs as arrays; PlanMismatch if they do not line up."""
    if not (cached.seq_ids or cached.num_scheduled_tokens or cached.num_computed_tokens
            or cached.num_new_blocks or cached.new_block_ids):  # new seqs only: skip the arrays
        return CachedSeqs()
    columns = CachedSeqs(
        np.array(cached.seq_ids, dtype=np.uint64),
        np.array(cached.num_scheduled_tokens, dtype=np.int64),
        np.array(cached.num_computed_tokens, dtype=np.int64),
        np.array(cached.num_new_blocks, dtype=np.int64),
        np.array(cached.new_block_ids, dtype=np.int64))
    num_seqs = len(columns.seq_ids)
    if not (len(columns.num_scheduled_tokens) == len(columns.num_computed_tokens)
            == len(columns.num_new_blocks) == num_seqs) or (
            int(columns.num_new_blocks.sum()) != len(columns.new_block_ids)):
        raise PlanMismatch("cached: columns of different lengths, or num_new_blocks does not "
                           "add up to new_block_ids")
    return columns


# Trailing metadata of an Execute stream ended by a plan that some seqs' own content failed
# (BadSeq): their ids, comma-separated; scheduler_svc.wire reads the same key.
BAD_SEQ_IDS_KEY = "pagedserve-bad-seq-ids"


def failure_metadata(err: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata naming the seqs that caused a failed step; () if none did."""
    seq_ids = getattr(err, "seq_ids", ())
    return ((BAD_SEQ_IDS_KEY, ",".join(str(i) for i in seq_ids)),) if seq_ids else ()


def result_to_proto(result: StepResult) -> executor_pb2.StepResult:
    """The result's message; its columns are extended into the fields in place (building the
    sub-messages apart would copy them once more)."""
    msg = executor_pb2.StepResult(step_id=result.step_id, forward_ms=result.forward_ms,
                                  step_ms=result.step_ms)
    if len(result.seq_ids):
        msg.sampled.seq_ids.extend(result.seq_ids.tolist())  # lists: extend reads them faster
        msg.sampled.token_ids.extend(result.token_ids.tolist())
    if result.logprobs:
        _fill_logprobs(result.logprobs, msg.logprobs)
    return msg


def _fill_logprobs(asked: tuple[SampledToken, ...], out: executor_pb2.SampledLogprobs) -> None:
    out.seq_ids.extend([t.seq_id for t in asked])
    out.logprobs.extend([t.logprob for t in asked])
    out.num_top_logprobs.extend([len(t.top_token_ids) for t in asked])
    out.top_token_ids.extend([i for t in asked for i in t.top_token_ids])
    out.top_logprobs.extend([lp for t in asked for lp in t.top_logprobs])


def info_to_proto(info: ExecutorInfo, instance_id: int) -> executor_pb2.DescribeResponse:
    return executor_pb2.DescribeResponse(
        **identity_fields(info),
        instance_id=instance_id,
        protocol_version=executor_pb2.PROTOCOL_VERSION,
        generation_config=_generation_config(info.generation_config),
        step_limits=_step_limits(info.step_limits),
        quantization=info.quantization,
        kv_cache_dtype=info.kv_cache_dtype or info.dtype,
    )


def _step_limits(limits: StepLimits | None) -> executor_pb2.StepLimits | None:
    if limits is None:
        return None
    return executor_pb2.StepLimits(
        max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
        bounded=limits.bounded, source=limits.source,
        decode_graph_sizes=limits.decode_graph_sizes,
        small_step_graph_sizes=limits.small_step_graph_sizes)


def _generation_config(g: ModelGenerationConfig) -> executor_pb2.GenerationConfig | None:
    """Only what the model sets: an unset default stays unset on the wire, as does the message
    of a model without a generation config."""
    if g == ModelGenerationConfig():
        return None
    values = {name: getattr(g, name) for name in _GENERATION_DEFAULTS}
    return executor_pb2.GenerationConfig(
        eos_token_ids=g.eos_token_ids,
        **{name: value for name, value in values.items() if value is not None})


_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                        "max_new_tokens")
