"""The executor's side of the step protocol: a plan's held seqs read as columns (hand-made
messages and columns together), and a result's sampled tokens written with whole-array ops that
upb reads exactly as the messages built one by one."""
import numpy as np
import pytest

from executor_svc import wire
from executor_svc.step import CachedSeq, SampledToken, StepResult
from protos import executor_pb2


def test_cached_seq_messages_come_before_the_columns():
    msg = executor_pb2.StepPlan(step_id=3, cached_seqs=[
        executor_pb2.CachedSeq(seq_id=9, num_scheduled_tokens=4, num_computed_tokens=2,
                               new_block_ids=[8])])
    msg.cached.seq_ids.extend([1, 2**63 + 5])
    msg.cached.num_scheduled_tokens.extend([1, 1])
    msg.cached.num_computed_tokens.extend([40, 47])
    msg.cached.num_new_blocks.extend([2, 0])
    msg.cached.new_block_ids.extend([6, 7])
    cached = wire.plan_from_proto(msg).cached_seqs
    assert list(cached) == [CachedSeq(9, 4, 2, [8]), CachedSeq(1, 1, 40, [6, 7]),
                            CachedSeq(2**63 + 5, 1, 47, [])]
    assert cached.seq_ids.dtype == np.uint64 and len(cached) == 3


@pytest.mark.parametrize("seq_ids, token_ids", [
    ([], []),
    ([0, 1, 127, 128, 16383, 16384, 2**63, 2**64 - 1], [0, 127, 128, 2**21, 5, 0, 1, 128255]),
    (list(range(1000, 1063)), list(range(63))),  # the most encoded one message at a time
    (list(range(1000, 2024)), [(7 * i) % 128256 for i in range(1024)]),
])
def test_sampled_tokens_encode_as_the_messages_would(seq_ids, token_ids):
    logprobs = (SampledToken(seq_ids[0], token_ids[0], -0.5, (3, 4), (-0.5, -2.0)),
                ) if seq_ids else ()
    result = StepResult(4, np.array(seq_ids, dtype=np.uint64), np.array(token_ids), 1.5, 2.5,
                        logprobs)
    expected = executor_pb2.StepResult(
        step_id=4, forward_ms=1.5, step_ms=2.5,
        sampled=[executor_pb2.SampledToken(seq_id=s, token_id=t)
                 for s, t in zip(seq_ids, token_ids)],
        logprobs=[executor_pb2.SampledLogprobs(seq_id=t.seq_id, logprob=t.logprob,
                                               top_token_ids=t.top_token_ids,
                                               top_logprobs=t.top_logprobs) for t in logprobs])
    msg = wire.result_to_proto(result)
    assert msg == expected
    assert executor_pb2.StepResult.FromString(msg.SerializeToString()) == expected
    assert [(t.seq_id, t.token_id) for t in result.sampled] == list(zip(seq_ids, token_ids))


def test_a_plan_of_new_seqs_reads_their_ids_as_ints_and_empty_cached_columns():
    token_ids = [0, 1, 127, 128, 2**31 - 1, 2**32 - 1] + list(range(2000))
    msg = executor_pb2.StepPlan(step_id=2, new_seqs=[executor_pb2.NewSeq(
        seq_id=5, token_ids=token_ids, block_table=[0, 2**31 - 1], num_computed_tokens=2000,
        num_scheduled_tokens=6)])
    step = wire.plan_from_proto(msg)
    (new,) = step.new_seqs
    assert new.token_ids == token_ids and new.block_table == [0, 2**31 - 1]
    assert all(type(t) is int for t in new.token_ids)
    cached = step.cached_seqs
    assert len(cached) == 0 and cached.seq_ids.dtype == np.uint64
    assert all(len(getattr(cached, name)) == 0 for name in (
        "num_scheduled_tokens", "num_computed_tokens", "num_new_blocks", "new_block_ids"))
