"""ModelRunner driven by hand-made StepPlans: greedy output token-identical to transformers'
generate, through batching, chunked prefill, swap out/in and copy-on-write forks."""
import random

import pytest

from tests.executor_svc.helpers import (PlanDriver, fork_on_write, hf_greedy, hf_model,
                                        make_runner, random_prompt, two_seqs_decoding)

NUM_NEW = 10


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-llama3"])
def test_batched_greedy_matches_hf_generate(preset):
    hf = hf_model(preset)
    driver = PlanDriver(make_runner(hf))
    rng = random.Random(10)
    prompts = {1: random_prompt(rng, 5), 2: random_prompt(rng, 12), 3: random_prompt(rng, 1)}
    # seq 2's prompt is chunked over two steps: it samples only when its prompt is complete.
    sampled = driver.run(new_seqs=[driver.new_seq(1, prompts[1]), driver.new_seq(2, prompts[2], 7)])
    assert set(sampled) == {1}
    sampled = driver.run(
        new_seqs=[driver.new_seq(3, prompts[3])],
        cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)],
    )
    assert set(sampled) == {1, 2, 3}
    while min(len(driver.tokens[s]) - len(prompts[s]) for s in prompts) < NUM_NEW:
        driver.run(cached_seqs=[driver.cached_seq(s) for s in prompts
                                if len(driver.tokens[s]) - len(prompts[s]) < NUM_NEW])
    for seq_id, prompt in prompts.items():
        assert driver.tokens[seq_id][len(prompt):] == hf_greedy(hf, prompt, NUM_NEW), seq_id


def test_swap_out_and_in_to_other_blocks_keeps_output():
    hf = hf_model("tiny")
    runner = make_runner(hf)
    driver = PlanDriver(runner)
    prompts = two_seqs_decoding(driver, 11)
    # Preempt seq 1 by swap: its pages go to CPU blocks, the executor forgets it.
    old_table = driver.tables.pop(1)
    cpu_blocks = [20 + i for i in range(len(old_table))]
    driver.run(swap_out=list(zip(old_table, cpu_blocks)), preempted_seq_ids=[1],
               cached_seqs=[driver.cached_seq(2)])
    assert 1 not in runner.input_batch
    runner.cache_engine.gpu_k[:, old_table] = float("nan")  # poison: data must come from swap space
    runner.cache_engine.gpu_v[:, old_table] = float("nan")
    driver.run(cached_seqs=[driver.cached_seq(2)])
    # Swap back in to different GPU blocks and re-admit as a new seq with its KV already there.
    new_table = [driver.free.pop() for _ in old_table]
    assert not set(new_table) & set(old_table)
    driver.tables[1] = list(new_table)
    computed = len(driver.tokens[1]) - 1
    driver.run(swap_in=list(zip(cpu_blocks, new_table)),
               new_seqs=[driver.new_seq(1, driver.tokens[1], 1, num_computed=computed)],
               cached_seqs=[driver.cached_seq(2)])
    for _ in range(3):
        driver.run(cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    for seq_id, prompt in prompts.items():
        new = driver.tokens[seq_id][len(prompt):]
        assert new == hf_greedy(hf, prompt, len(new)), seq_id


def test_copy_on_write_fork_decodes_like_parent():
    hf = hf_model("tiny")
    runner = make_runner(hf)
    driver = PlanDriver(runner)
    prompt = random_prompt(random.Random(12), 10)  # 3 blocks of 4, the last one half full
    driver.run(new_seqs=[driver.new_seq(1, prompt)])
    fork_on_write(driver, 1, 2)
    for _ in range(5):
        driver.run(cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    expected = hf_greedy(hf, prompt, len(driver.tokens[1]) - len(prompt))
    assert driver.tokens[1][len(prompt):] == expected
    assert driver.tokens[2] == driver.tokens[1]


def test_recompute_after_reset_gives_the_same_tokens():
    """Executor state loss: re-admitting prompt + generated tokens continues identically."""
    hf = hf_model("tiny")
    runner = make_runner(hf)
    driver = PlanDriver(runner)
    prompt = random_prompt(random.Random(13), 7)
    driver.run(new_seqs=[driver.new_seq(1, prompt)])
    for _ in range(3):
        driver.run(cached_seqs=[driver.cached_seq(1)])
    runner.reset()
    fresh = PlanDriver(runner, seed=5)
    fresh.step_id = 100  # a new stream may start at any step id
    fresh.run(new_seqs=[fresh.new_seq(1, driver.tokens[1])])
    for _ in range(3):
        fresh.run(cached_seqs=[fresh.cached_seq(1)])
    assert fresh.tokens[1][len(prompt):] == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("graphs", [False, True])
def test_longest_first_batches_keep_every_seqs_output(graphs):
    """One-token seqs lead the batch by descending context, a mixed step's prompt chunk after
    them, and every seq's greedy output is transformers'."""
    from tests.executor_svc.helpers import with_eager_graphs

    hf = hf_model("tiny")
    runner = make_runner(hf)
    if graphs:
        with_eager_graphs(runner)
    orders = []
    real_run = runner._run

    def spy(step_id, batch, marks):
        orders.append([(int(n), int(runner.input_batch.num_computed[r]))
                       for r, n in zip(batch.rows, batch.num_scheduled)])
        return real_run(step_id, batch, marks)

    runner._run = spy
    driver = PlanDriver(runner)
    rng = random.Random(11)
    prompts = {1: random_prompt(rng, 3), 2: random_prompt(rng, 14), 3: random_prompt(rng, 7),
               4: random_prompt(rng, 9)}
    driver.run(new_seqs=[driver.new_seq(s, prompts[s]) for s in (1, 2, 3)])
    # seq 4 arrives beside three decodes: a mixed step
    driver.run(new_seqs=[driver.new_seq(4, prompts[4])],
               cached_seqs=[driver.cached_seq(s) for s in (1, 2, 3)])
    while min(len(driver.tokens[s]) - len(prompts[s]) for s in prompts) < NUM_NEW:
        driver.run(cached_seqs=[driver.cached_seq(s) for s in prompts
                                if len(driver.tokens[s]) - len(prompts[s]) < NUM_NEW])
    for seq_id, prompt in prompts.items():
        assert driver.tokens[seq_id][len(prompt):] == hf_greedy(hf, prompt, NUM_NEW), seq_id
    mixed = orders[1]
    assert [n for n, _ in mixed] == [1, 1, 1, 9]
    for order in orders[1:]:
        ones = [c for n, c in order if n == 1]
        assert ones == sorted(ones, reverse=True)
    # the first step of four decodes: the plan lists seqs 1-4, the batch runs 2, 4, 3, 1
    assert [c for _, c in orders[2]] == [15, 9, 8, 4]
