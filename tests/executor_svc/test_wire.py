"""The executor's side of the step protocol: a plan's held seqs read as columns (refused when the
columns do not line up), and a result's sampled tokens and logprobs written as columns."""
import numpy as np
import pytest

from executor_svc import wire
from executor_svc.step import ExecutorInfo, PlanMismatch, SampledToken, StepResult
from protos import executor_pb2


def _cached(**columns) -> executor_pb2.StepPlan:
    return executor_pb2.StepPlan(step_id=3, cached=executor_pb2.CachedSeqs(**columns))


def test_cached_columns_read_as_arrays():
    msg = _cached(seq_ids=[9, 1, 2**63 + 5], num_scheduled_tokens=[4, 1, 1],
                  num_computed_tokens=[2, 40, 47], num_new_blocks=[1, 2, 0],
                  new_block_ids=[8, 6, 7])
    cached = wire.plan_from_proto(msg).cached_seqs
    assert list(cached) == [(9, 4, 2, [8]), (1, 1, 40, [6, 7]), (2**63 + 5, 1, 47, [])]
    assert cached.seq_ids.dtype == np.uint64 and len(cached) == 3


@pytest.mark.parametrize("columns", [
    dict(seq_ids=[1, 2], num_scheduled_tokens=[1], num_computed_tokens=[4, 4],
         num_new_blocks=[0, 0]),
    dict(seq_ids=[1], num_scheduled_tokens=[1], num_computed_tokens=[4], num_new_blocks=[2],
         new_block_ids=[5]),
    dict(new_block_ids=[5]),
], ids=["short-column", "blocks-short", "blocks-of-no-seq"])
def test_cached_columns_that_do_not_line_up_are_a_plan_mismatch(columns):
    with pytest.raises(PlanMismatch, match="cached: columns"):
        wire.plan_from_proto(_cached(**columns))


@pytest.mark.parametrize("seq_ids, token_ids", [
    ([], []),
    ([0, 1, 127, 128, 16383, 16384, 2**63, 2**64 - 1], [0, 127, 128, 2**21, 5, 0, 1, 128255]),
    (list(range(1000, 2024)), [(7 * i) % 128256 for i in range(1024)]),
])
def test_sampled_tokens_cross_as_columns(seq_ids, token_ids):
    result = StepResult(4, np.array(seq_ids, dtype=np.uint64), np.array(token_ids), 1.5, 2.5)
    msg = executor_pb2.StepResult.FromString(wire.result_to_proto(result).SerializeToString())
    assert (msg.step_id, msg.forward_ms, msg.step_ms) == (4, 1.5, 2.5)
    assert (list(msg.sampled.seq_ids), list(msg.sampled.token_ids)) == (seq_ids, token_ids)
    assert not msg.HasField("logprobs")


def test_logprobs_cross_as_columns_with_each_seqs_count_of_top_ones():
    asked = (SampledToken(7, 4, -0.5, (4, 2), (-0.5, -1.5)), SampledToken(2**64 - 1, 9, -3.0),
             SampledToken(8, 1, -0.25, (1,), (-0.25,)))
    result = StepResult(4, np.array([7, 2**64 - 1, 8, 9], dtype=np.uint64),
                        np.array([4, 9, 1, 0]), 0.0, 0.0, asked)
    msg = executor_pb2.StepResult.FromString(wire.result_to_proto(result).SerializeToString())
    columns = msg.logprobs
    assert list(columns.seq_ids) == [7, 2**64 - 1, 8]
    assert list(columns.logprobs) == [-0.5, -3.0, -0.25]  # exact in float32
    assert list(columns.num_top_logprobs) == [2, 0, 1]
    assert list(columns.top_token_ids) == [4, 2, 1]
    assert list(columns.top_logprobs) == [-0.5, -1.5, -0.25]


def test_a_plan_of_new_seqs_reads_their_ids_as_ints_and_empty_cached_columns():
    token_ids = [0, 1, 127, 128, 2**31 - 1, 2**32 - 1] + list(range(2000))
    msg = executor_pb2.StepPlan(step_id=2, new_seqs=[executor_pb2.NewSeq(
        seq_id=5, token_ids=token_ids, block_table=[0, 2**31 - 1], num_computed_tokens=2000,
        num_scheduled_tokens=6, first_position=1999)])
    step = wire.plan_from_proto(msg)
    (new,) = step.new_seqs
    assert new.token_ids == token_ids and new.block_table == [0, 2**31 - 1]
    assert new.first_position == 1999 and new.num_tokens == 1999 + len(token_ids)
    assert all(type(t) is int for t in new.token_ids)
    cached = step.cached_seqs
    assert len(cached) == 0 and cached.seq_ids.dtype == np.uint64
    assert all(len(getattr(cached, name)) == 0 for name in (
        "num_scheduled_tokens", "num_computed_tokens", "num_new_blocks", "new_block_ids"))


def test_describe_names_the_protocol_version():
    info = ExecutorInfo("m", "fp", "float32", 4, 16, 0, 64, 100, "", "cpu")
    msg = wire.info_to_proto(info, instance_id=5)
    assert msg.protocol_version == executor_pb2.PROTOCOL_VERSION >= 1
