"""Conversions between the Executor protobuf messages and executor_svc.step's dataclasses. The
per-seq columns of a plan and of a result cross as numpy arrays, never an object per seq."""
from __future__ import annotations

import dataclasses

import numpy as np

from protos import executor_pb2
from executor_svc.step import (CachedSeq, CachedSeqs, ExecutorInfo, NewSeq, PlanMismatch,
                               SamplingOptions, StepPlan, StepResult)


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
            NewSeq(seq_id=s.seq_id, token_ids=_ints(s.token_ids), block_table=list(s.block_table),
                   num_computed_tokens=s.num_computed_tokens,
                   num_scheduled_tokens=s.num_scheduled_tokens, sampling=_sampling(s.sampling),
                   num_prompt_tokens=s.num_prompt_tokens or None, first_token=s.first_token)
            for s in plan.new_seqs
        ],
        cached_seqs=_cached_seqs(plan),
        finished_seq_ids=list(plan.finished_seq_ids),
        preempted_seq_ids=list(plan.preempted_seq_ids),
    )


def _ints(values) -> list[int]:
    """A repeated integer field as a list: read through numpy (upb hands it over as one buffer),
    faster than list() for long fields."""
    return np.asarray(values).tolist()


def _cached_seqs(plan: executor_pb2.StepPlan) -> CachedSeqs:
    """`cached_seqs` (one message each: hand-made plans), then the columns of `cached`."""
    columns = _cached_columns(plan.cached)
    if not plan.cached_seqs:
        return columns
    messages = CachedSeqs.of(
        CachedSeq(s.seq_id, s.num_scheduled_tokens, s.num_computed_tokens, list(s.new_block_ids))
        for s in plan.cached_seqs)
    return CachedSeqs(*(np.concatenate([getattr(messages, f.name), getattr(columns, f.name)])
                        for f in dataclasses.fields(CachedSeqs)))


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
    msg = executor_pb2.StepResult(
        step_id=result.step_id,
        logprobs=[executor_pb2.SampledLogprobs(seq_id=t.seq_id, logprob=t.logprob,
                                               top_token_ids=t.top_token_ids,
                                               top_logprobs=t.top_logprobs)
                  for t in result.logprobs],
        forward_ms=result.forward_ms,
        step_ms=result.step_ms,
    )
    if len(result.seq_ids) < _FEW_SAMPLED:
        msg.sampled.extend(executor_pb2.SampledToken(seq_id=seq_id, token_id=token_id)
                           for seq_id, token_id in zip(_ints(result.seq_ids),
                                                       _ints(result.token_ids)))
    else:
        msg.MergeFromString(_sampled_field(result.seq_ids, result.token_ids))
    return msg


# Below this many sampled seqs, building the messages one by one costs less than
# _sampled_field's fixed ~20 whole-array ops.
_FEW_SAMPLED = 64


_SAMPLED_TAG = 2 << 3 | 2  # StepResult.sampled: field 2, length-delimited
_SEQ_ID_TAG, _TOKEN_ID_TAG = 1 << 3, 2 << 3  # SampledToken's fields 1 and 2, varints


def _sampled_field(seq_ids: np.ndarray, token_ids: np.ndarray) -> bytes:
    """StepResult.sampled encoded with whole-array ops: one SampledToken per (seq id, token id)
    (what upb parses into the message; building a SampledToken per seq in Python is what this
    avoids at large batches). Each entry: tag, length, tag, varint seq id, tag, varint token id."""
    seq_ids = np.asarray(seq_ids, dtype=np.uint64)
    token_ids = np.asarray(token_ids, dtype=np.uint64)
    seq_len, token_len = _varint_lengths(seq_ids), _varint_lengths(token_ids)
    entry_len = 2 + seq_len + token_len  # < 128: a one-byte length
    ends = np.cumsum(entry_len + 2)
    starts = ends - entry_len - 2
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    out[starts] = _SAMPLED_TAG
    out[starts + 1] = entry_len
    out[starts + 2] = _SEQ_ID_TAG
    _put_varints(out, starts + 3, seq_ids, seq_len)
    token_at = starts + 3 + seq_len
    out[token_at] = _TOKEN_ID_TAG
    _put_varints(out, token_at + 1, token_ids, token_len)
    return out.tobytes()


_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's varint (7 bits a byte): [n] int64."""
    return np.searchsorted(_VARINT_LIMITS, values, side="right") + 1


def _put_varints(out: np.ndarray, at: np.ndarray, values: np.ndarray, lengths: np.ndarray
                 ) -> None:
    """Writes value i's varint at out[at[i]:at[i] + lengths[i]]: low 7 bits first, the high
    bit set on all bytes but the last."""
    first = np.cumsum(lengths) - lengths  # [n]: where each value's bytes start, packed
    k = np.arange(int(lengths.sum())) - np.repeat(first, lengths)  # [bytes]: index in its value
    groups = (np.repeat(values, lengths) >> (7 * k).astype(np.uint64)) & np.uint64(0x7F)
    more = (k < np.repeat(lengths - 1, lengths)).astype(np.uint64) << np.uint64(7)
    out[np.repeat(at, lengths) + k] = groups | more


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
