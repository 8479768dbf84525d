"""PlanMismatch on plans that contradict executor state; a rejected plan changes nothing."""
import random

import pytest
import torch

from executor_svc.step import CachedSeqs, NewSeq, PlanMismatch, SamplingOptions, StepPlan
from tests.executor_svc.helpers import PlanDriver, hf_model, make_runner, random_prompt


@pytest.fixture
def driver():
    driver = PlanDriver(make_runner(hf_model("tiny"), num_gpu_blocks=16, num_cpu_blocks=4))
    prompt = random_prompt(random.Random(20), 6)
    driver.run(new_seqs=[driver.new_seq(1, prompt)])
    return driver


def _snapshot(runner):
    batch = runner.input_batch
    rows = {seq_id: batch.row(seq_id) for seq_id in batch.seq_ids}
    tables = {seq_id: batch.block_table.table(row) for seq_id, row in rows.items()}
    seqs = {seq_id: (row, batch.sampling[row], batch.count_row[row], batch.tokens(row).tolist(),
                     int(batch.num_tokens[row]), int(batch.num_computed[row]))
            for seq_id, row in rows.items()}
    return (seqs, runner.last_step_id, runner.cache_engine.gpu_k.clone(),
            runner.cache_engine.cpu_k.clone(), tables)


def _assert_rejected(driver, step):
    runner = driver.runner
    before = _snapshot(runner)
    with pytest.raises(PlanMismatch):
        runner.launch(step)  # checks the whole plan before changing anything
    after = _snapshot(runner)
    assert after[0] == before[0] and after[1] == before[1] and after[4] == before[4]
    assert torch.equal(after[2].nan_to_num(), before[2].nan_to_num())
    assert torch.equal(after[3].nan_to_num(), before[3].nan_to_num())


def _decode_ok(driver) -> CachedSeqs:
    return CachedSeqs.of([(1, 1, driver.computed[1], [])])


def test_unknown_cached_seq(driver):
    _assert_rejected(driver, StepPlan(2, cached_seqs=CachedSeqs.of([(99, 1, 0, [])])))


def test_counter_mismatch(driver):
    _assert_rejected(driver,
                     StepPlan(2, cached_seqs=CachedSeqs.of([(1, 1, driver.computed[1] - 1, [])])))


@pytest.mark.parametrize("step_id", [1, 3, 10])
def test_step_gap_or_repeat(driver, step_id):
    _assert_rejected(driver, StepPlan(step_id, cached_seqs=_decode_ok(driver)))


def test_out_of_range_blocks(driver):
    new = NewSeq(2, [5, 6, 7], [16], 0, 3, SamplingOptions())
    _assert_rejected(driver, StepPlan(2, new_seqs=[new], cached_seqs=_decode_ok(driver)))
    _assert_rejected(driver, StepPlan(2, swap_out=[(0, 4)], cached_seqs=_decode_ok(driver)))
    _assert_rejected(driver, StepPlan(2, swap_in=[(0, 16)]))
    _assert_rejected(driver, StepPlan(2, copy=[(-1, 3)]))
    _assert_rejected(driver,
                     StepPlan(2, cached_seqs=CachedSeqs.of([(1, 1, driver.computed[1], [99])])))


def test_bad_new_seqs(driver):
    table = [driver.free[0], driver.free[1]]
    cases = [
        NewSeq(1, [5, 6], table, 0, 2, SamplingOptions()),  # duplicate of a known seq
        NewSeq(2, [5, 6], table, 1, 2, SamplingOptions()),  # computed + scheduled > tokens
        NewSeq(2, list(range(3, 12)), table[:1], 0, 9, SamplingOptions()),  # table too short
        NewSeq(2, [5, 10**6], table, 0, 2, SamplingOptions()),  # token out of vocabulary
        # tokens omitted past the computed ones (they must come: the executor reads them)
        NewSeq(2, [7], table, 2, 1, SamplingOptions(), first_position=3),
        # tokens omitted though a penalty counts every token
        NewSeq(2, [7], table, 2, 1, SamplingOptions(presence_penalty=0.5), first_position=2),
        NewSeq(2, [7] * 600, table, 4, 1, SamplingOptions(), first_position=4),  # 604 tokens > 512
        NewSeq(2, [7], table, 2**32 - 2, 1, SamplingOptions(), first_position=2**32 - 2),  # huge
        NewSeq(2, [], table, 3, 1, SamplingOptions(), first_position=3),  # nothing left to compute
    ]
    for new in cases:
        _assert_rejected(driver, StepPlan(2, new_seqs=[new]))
    # more blocks than max_model_len (512 tokens, 4 per block) can need
    _assert_rejected(driver, StepPlan(2, new_seqs=[NewSeq(2, [5, 6], table * 65, 0, 2)]))
    _assert_rejected(driver, StepPlan(2, cached_seqs=CachedSeqs.of([
        (1, 1, driver.computed[1], [driver.free[0]] * 128)])))
    dup = NewSeq(2, [5, 6], table, 0, 2, SamplingOptions())
    _assert_rejected(driver, StepPlan(2, new_seqs=[dup, dup]))


def test_state_intact_after_rejection_and_plan_continues(driver):
    # A valid swap in the same plan must not have been applied when a later part is rejected.
    runner = driver.runner
    runner.cache_engine.cpu_k.zero_()
    bad = StepPlan(2, swap_out=[(driver.tables[1][0], 0)],
                   cached_seqs=CachedSeqs.of([(1, 1, 0, [])]))
    _assert_rejected(driver, bad)
    assert runner.cache_engine.cpu_k.abs().sum() == 0
    sampled = driver.run(cached_seqs=[driver.cached_seq(1)])
    assert set(sampled) == {1}


def test_finished_and_preempted_drop_state(driver):
    driver.run(finished_seq_ids=[1])
    assert not len(driver.runner.input_batch)
    _assert_rejected(driver, StepPlan(driver.step_id + 1,
                                      cached_seqs=CachedSeqs.of([(1, 1, 7, [])])))
