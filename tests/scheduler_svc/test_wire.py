"""The executor protocol's plan encoding: what the scheduler sends is what the executor reads,
cached seqs in columns included; columns that do not line up are refused as a plan mismatch."""

import pytest

from executor_svc import wire as executor_wire
from executor_svc.step import CachedSeq, PlanMismatch
from protos import executor_pb2
from scheduler_svc import wire
from scheduler_svc.plan import CachedSeqPlan, NewSeqPlan, StepPlan
from scheduler_svc.sampling_params import SamplingParams


def sample_plan() -> StepPlan:
    new = NewSeqPlan(7, [5, 6, 7], [3], 0, 3, SamplingParams(temperature=0.5), seed=11)
    cached = [CachedSeqPlan(1, 1, 40, []), CachedSeqPlan(2, 1, 47, [9]),
              CachedSeqPlan(3, 16, 0, [4, 5]), CachedSeqPlan(4, 1, 20, [])]
    return StepPlan(5, swap_out=[(1, 2)], copy=[(6, 8)], new_seqs=[new], cached_seqs=cached,
                    finished_seq_ids=[12], preempted_seq_ids=[13])


def test_plan_round_trip_through_the_executor_wire():
    plan = sample_plan()
    data = wire.plan_to_proto(plan).SerializeToString()
    step = executor_wire.plan_from_proto(executor_pb2.StepPlan.FromString(data))
    assert step.cached_seqs == [CachedSeq(s.seq_id, s.num_scheduled_tokens, s.num_computed_tokens,
                                          s.new_block_ids) for s in plan.cached_seqs]
    assert [s.seq_id for s in step.new_seqs] == [7] and step.new_seqs[0].sampling.seed == 11
    assert (step.step_id, step.swap_out, step.copy) == (5, [(1, 2)], [(6, 8)])
    assert (step.finished_seq_ids, step.preempted_seq_ids) == ([12], [13])


def test_cached_seqs_columns_and_views_agree():
    plan = sample_plan()
    assert plan.cached_seqs.num_new_blocks == [0, 1, 2, 0]
    assert plan.cached_seqs.new_block_ids == [9, 4, 5]
    assert plan.cached_seqs[2] == CachedSeqPlan(3, 16, 0, [4, 5])
    assert plan.num_scheduled_tokens == 3 + 19 and plan.num_scheduled_seqs == 5


def test_plan_without_cached_seqs_leaves_the_field_unset():
    assert not wire.plan_to_proto(StepPlan(1, finished_seq_ids=[3])).HasField("cached")


@pytest.mark.parametrize("field, values", [
    ("num_computed_tokens", [40]),  # one value short
    ("num_new_blocks", [0, 2]),  # more blocks than new_block_ids holds
])
def test_misaligned_columns_are_a_plan_mismatch(field, values):
    msg = wire.plan_to_proto(StepPlan(2, cached_seqs=[CachedSeqPlan(1, 1, 40, []),
                                                      CachedSeqPlan(2, 1, 47, [9])]))
    getattr(msg.cached, field)[:] = values
    with pytest.raises(PlanMismatch):
        executor_wire.plan_from_proto(msg)
