"""A plan that fails because of one new seq's own content (a token id out of the vocabulary, a
sampling option no filter takes) ends the Execute stream FAILED_PRECONDITION naming that seq in
its trailing metadata, and the scheduler's real ExecutorClient surfaces the name (ExecutorLost's
seq_ids), over gRPC in process. A mismatch that is no seq's fault names none."""
from __future__ import annotations

import asyncio
import math

import pytest

from executor_svc.config import ExecutorConfig
from executor_svc.server import build_server
from executor_svc.step import BadSeq, PlanMismatch, SamplingOptions
from executor_svc.worker import Worker
from scheduler_svc.executor_client import ExecutorClient, ExecutorLost
from scheduler_svc.plan import CachedSeqs, NewSeqPlan, StepPlan
from scheduler_svc.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def address():
    runner = Worker(ExecutorConfig(model="preset:tiny", block_size=4, num_gpu_blocks=12,
                                   swap_space_gib=0.0005)).runner
    server, port = build_server(runner, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", runner.info.vocab_size
    server.stop(None)


def new_seq(seq_id: int, token_ids=(1, 2, 3), **sampling) -> NewSeqPlan:
    # SamplingParams is not validated here: these values stand for what a scheduler let through
    return NewSeqPlan(seq_id, list(token_ids), [seq_id % 12], 0, len(token_ids),
                      SamplingParams(**sampling), seed=seq_id)


async def first_failure(address: str, plans: list[StepPlan]) -> ExecutorLost:
    """Sends `plans` on a fresh stream, reads their results; the ExecutorLost that ends it."""
    client = ExecutorClient([address])
    await client.connect()
    try:
        for plan in plans:
            await client.send(plan)
        for plan in plans:
            await client.receive(plan)
    except ExecutorLost as lost:
        return lost
    finally:
        await client.close()
    raise AssertionError("the stream did not fail")


@pytest.mark.parametrize("bad", [
    {"token_ids": (1, 10**6)},  # the fixture asserts the vocabulary is smaller
    {"temperature": math.nan},
    {"top_p": math.inf},
    {"repetition_penalty": -1.0},
    {"logit_bias": ((10**6, 1.0),)},
    {"logprobs": 10**6}])
def test_a_bad_new_seq_is_named_and_its_step_fails(address, bad):
    address, vocab_size = address
    assert vocab_size < 10**6
    plans = [StepPlan(1, new_seqs=[new_seq(1)]),
             StepPlan(2, new_seqs=[new_seq(2), new_seq(3, **bad)])]
    lost = asyncio.run(first_failure(address, plans))
    assert lost.seq_ids == (3,)
    assert "FAILED_PRECONDITION" in str(lost) and "seq 3" in str(lost)


def test_a_mismatch_that_is_no_seqs_fault_names_none(address):
    address, _ = address
    plans = [StepPlan(1, new_seqs=[new_seq(1)]),
             StepPlan(2, cached_seqs=CachedSeqs.of([(1, 1, 2, [])]))]  # 2 computed, not 3
    lost = asyncio.run(first_failure(address, plans))
    assert lost.seq_ids == () and "FAILED_PRECONDITION" in str(lost)


def test_sampling_problems_are_found_before_any_state_changes():
    assert SamplingOptions().problem(100) is None
    assert SamplingOptions(temperature=0.7, top_p=0.5, min_p=0.1, repetition_penalty=1.2,
                           logit_bias=((99, -100.0),), logprobs=20).problem(100) is None
    assert "not finite" in SamplingOptions(logit_bias=((1, math.inf),)).problem(100)
    assert "vocabulary" in SamplingOptions(logit_bias=((100, 1.0),)).problem(100)
    err = BadSeq(5, "why")
    assert isinstance(err, PlanMismatch) and err.seq_ids == (5,) and str(err) == "seq 5: why"
