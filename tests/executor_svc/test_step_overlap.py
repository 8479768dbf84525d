"""Launching step N+1 before step N is finished: the real scheduler's plans (two in flight) give
the same tokens and logprobs as finishing every step at once, through chunked prefill, decode,
preemption by swap and by recompute, finished and aborted seqs and seeded sampling, eagerly and
through the decode-graph input path; and the runner's rules for unfinished steps."""
import random

import pytest

from executor_svc.step import CachedSeqs, PlanMismatch, StepPlan
from tests.executor_svc.helpers import (
    PlanDriver, RunnerLink, ScheduledRun, add_workload, execute, held_num_tokens, held_tokens,
    hf_greedy, hf_model, make_runner, make_scheduler, random_prompt, with_eager_graphs,
)


def scheduled_run(overlap: bool, num_cpu_blocks: int, graphs: bool = False):
    runner = make_runner(hf_model("tiny"), num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks)
    if graphs:
        with_eager_graphs(runner)
    sched = make_scheduler(runner.info, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = add_workload(sched, seed=4)
    link = RunnerLink(runner, overlap)
    # Seq 8 is aborted with a step in flight: the next plan drops it while its token is unfinished.
    run = ScheduledRun(sched, link).run(between=lambda step_id: step_id == 6 and sched.abort_seq(8))
    return run, link, sched, prompts


@pytest.mark.parametrize("num_cpu_blocks", [16, 0])  # preemption by swap, then by recompute
@pytest.mark.parametrize("graphs", [False, True])
def test_overlapped_steps_give_the_same_tokens_and_logprobs(num_cpu_blocks, graphs):
    serial, _, _, _ = scheduled_run(False, num_cpu_blocks, graphs)
    overlapped, link, sched, prompts = scheduled_run(True, num_cpu_blocks, graphs)
    assert overlapped.results == serial.results
    assert any(lp is not None for _, sampled in serial.results for *_, lp in sampled)  # compared
    assert overlapped.outputs == serial.outputs
    assert link.launched_with_pending > len(overlapped.results) // 2
    if num_cpu_blocks:
        assert sched.num_preemptions_swap > 0
    else:
        assert sched.num_preemptions_recompute > 0
    hf = hf_model("tiny")
    for seq_id in range(1, 11, 2):  # the greedy ones
        out = overlapped.outputs[seq_id]
        assert out == hf_greedy(hf, prompts[seq_id], len(out)), seq_id


def test_validation_counts_the_unfinished_token():
    hf = hf_model("tiny")
    runner = make_runner(hf)
    driver = PlanDriver(runner)
    prompt = random_prompt(random.Random(1), 7)  # 2 blocks of 4: room for one more token
    prefill = runner.launch(StepPlan(1, new_seqs=[driver.new_seq(1, prompt)]))
    assert held_num_tokens(runner, 1) == 8 and len(held_tokens(runner, 1)) == 7
    with pytest.raises(PlanMismatch, match="exceeds its 8 tokens"):
        runner.launch(StepPlan(2, cached_seqs=CachedSeqs.of([(1, 2, 7, [])])))
    decode = runner.launch(StepPlan(2, cached_seqs=CachedSeqs.of([(1, 1, 7, [])])))
    with pytest.raises(RuntimeError, match="not the oldest"):
        runner.finish(decode)
    first, second = runner.finish(prefill), runner.finish(decode)
    assert [first.step_id, second.step_id] == [1, 2]
    tokens = [first.sampled[0].token_id, second.sampled[0].token_id]
    assert tokens == hf_greedy(hf, prompt, 2) == held_tokens(runner, 1)[7:].tolist()
    assert held_num_tokens(runner, 1) == len(held_tokens(runner, 1))
    assert runner.num_pending_steps == 0


def test_a_seq_dropped_while_its_token_is_unfinished_still_gets_it():
    runner = make_runner(hf_model("tiny"))
    driver = PlanDriver(runner)
    rng = random.Random(2)
    first = runner.launch(StepPlan(1, new_seqs=[driver.new_seq(s, random_prompt(rng, 5))
                                               for s in (1, 2)]))
    second = runner.launch(StepPlan(2, finished_seq_ids=[1],
                                    cached_seqs=CachedSeqs.of([(2, 1, 5, [])])))
    assert runner.input_batch.seq_ids == [2]
    assert [t.seq_id for t in runner.finish(first).sampled] == [1, 2]
    assert [t.seq_id for t in runner.finish(second).sampled] == [2]
    assert len(held_tokens(runner, 2)) == 7


def test_reset_forgets_unfinished_steps():
    runner = make_runner(hf_model("tiny"))
    driver = PlanDriver(runner)
    pending = runner.launch(StepPlan(1, new_seqs=[driver.new_seq(1, [5, 6, 7])]))
    runner.reset()
    assert runner.num_pending_steps == 0 and not len(runner.input_batch)
    with pytest.raises(RuntimeError):
        runner.finish(pending)
    out = execute(runner, StepPlan(40, new_seqs=[driver.new_seq(2, [5, 6, 7])]))
    assert [t.seq_id for t in out.sampled] == [2]


def test_a_dropped_seqs_unfinished_token_never_lands_in_the_row_of_the_seq_after_it():
    runner = make_runner(hf_model("tiny"))
    driver = PlanDriver(runner)
    first = runner.launch(StepPlan(1, new_seqs=[driver.new_seq(1, [5, 6, 7])]))
    row = runner.input_batch.row(1)
    second = runner.launch(StepPlan(2, finished_seq_ids=[1],
                                    new_seqs=[driver.new_seq(2, [8, 9, 10, 11])]))
    assert runner.input_batch.row(2) == row  # the freed row, taken at once
    runner.finish(first)
    assert held_tokens(runner, 2).tolist() == [8, 9, 10, 11] and held_num_tokens(runner, 2) == 5
    [token] = runner.finish(second).sampled
    assert held_tokens(runner, 2).tolist() == [8, 9, 10, 11, token.token_id]
