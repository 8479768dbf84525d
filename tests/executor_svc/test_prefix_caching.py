"""Prefix caching end to end on the CPU runner: the real scheduler (two steps in flight) with
caching on gives the same greedy tokens as with caching off, on multi-turn conversations and on
64 requests sharing a system prompt, under preemption by swap and by recompute; the cache is hit,
swaps copy fewer pages (a shared page once), and every page is free at the end."""
import random

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence
from tests.executor_svc.helpers import (
    RunnerLink, ScheduledRun, hf_greedy, hf_model, make_runner, random_prompt,
)

BLOCK_SIZE = 4


def caching_scheduler(runner, caching: bool, **config) -> Scheduler:
    info = runner.info
    bm = BlockManager(info.block_size, info.num_gpu_blocks, info.num_cpu_blocks,
                      enable_prefix_caching=caching, cache_salt=info.fingerprint)
    return Scheduler(SchedulerConfig(enable_prefix_caching=caching, **config), bm,
                     rng=random.Random(0))


def greedy_seq(seq_id: int, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(seq_id, prompt, SamplingParams(), StoppingParams(max_tokens=max_tokens),
                    eos_token_id=None, max_model_len=512, arrival_time=float(seq_id))


def assert_pools_whole(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


def system_prompt_run(caching: bool, num_cpu_blocks: int, overlap: bool = True):
    """64 requests: one 22-token system prompt, then 1-6 tokens of their own."""
    runner = make_runner(hf_model("tiny"), block_size=BLOCK_SIZE, num_gpu_blocks=40,
                         num_cpu_blocks=num_cpu_blocks)
    sched = caching_scheduler(runner, caching, max_num_batched_tokens=48, max_num_seqs=12)
    rng = random.Random(7)
    system = random_prompt(rng, 22)
    prompts = {}
    for seq_id in range(1, 65):
        prompts[seq_id] = system + random_prompt(rng, rng.randint(1, 6))
        sched.add_seq(greedy_seq(seq_id, prompts[seq_id], rng.randint(2, 10)))
    link = RunnerLink(runner, overlap)
    run = ScheduledRun(sched, link).run()
    assert_pools_whole(sched)
    # A new seq whose prefix is cached (or whose pages came back from a swap) sends only the
    # tokens past it: the KV holds the rest. Without either, every token travels.
    if caching:
        assert link.tokens_omitted > link.tokens_sent
    elif not num_cpu_blocks:
        assert link.tokens_omitted == 0
    return run, sched, prompts


@pytest.mark.parametrize("num_cpu_blocks", [24, 0])  # preemption by swap, then by recompute
def test_64_requests_sharing_a_system_prompt_give_the_same_tokens_cached_or_not(num_cpu_blocks):
    plain, plain_sched, prompts = system_prompt_run(False, num_cpu_blocks)
    cached, sched, _ = system_prompt_run(True, num_cpu_blocks)
    assert cached.outputs == plain.outputs
    stats = sched.stats()
    assert stats.num_prefix_cache_hits >= 56 * 20  # all but the first few hit 5 pages
    assert plain_sched.stats().num_prefix_cache_hits == 0
    preemptions = stats.num_preemptions_swap if num_cpu_blocks else stats.num_preemptions_recompute
    assert preemptions > 0
    if num_cpu_blocks:  # issue 12: the shared pages are not copied again by every swap
        plain_stats = plain_sched.stats()
        assert plain_stats.num_blocks_swap_shared_out == plain_stats.num_blocks_swap_shared_in == 0
        assert stats.num_blocks_swap_shared_in > 0  # the system prompt's pages, still on the GPU
        assert (stats.num_blocks_swapped_out + stats.num_blocks_swapped_in
                < plain_stats.num_blocks_swapped_out + plain_stats.num_blocks_swapped_in)
    hf = hf_model("tiny")
    for seq_id in (1, 2, 33, 64):
        out = cached.outputs[seq_id]
        assert out == hf_greedy(hf, prompts[seq_id], len(out)), seq_id


def conversation_run(caching: bool, num_cpu_blocks: int, preemption_mode: str):
    """Six conversations of four turns, interleaved: each turn's prompt is the previous
    prompt, its answer and a new user message; the next turn starts once the answer is back."""
    runner = make_runner(hf_model("tiny"), block_size=BLOCK_SIZE, num_gpu_blocks=24,
                         num_cpu_blocks=num_cpu_blocks)
    sched = caching_scheduler(runner, caching, max_num_batched_tokens=32, max_num_seqs=6,
                              preemption_mode=preemption_mode)
    rng = random.Random(3)
    num_turns, prompts, turn_of = 4, {}, {}
    for conv in range(6):
        seq_id = conv * 10 + 1
        prompts[seq_id] = random_prompt(rng, rng.randint(5, 14))
        turn_of[seq_id] = (conv, 1)
        sched.add_seq(greedy_seq(seq_id, prompts[seq_id], 6))
    run = ScheduledRun(sched, RunnerLink(runner, overlap=True))

    def next_turns(_step_id):
        for seq_id, (conv, turn) in list(turn_of.items()):
            if sched.get_seq(seq_id) is None and turn < num_turns:
                del turn_of[seq_id]
                new_id = conv * 10 + turn + 1
                prompts[new_id] = (prompts[seq_id] + run.outputs[seq_id]
                                   + random_prompt(random.Random(new_id), 3))
                turn_of[new_id] = (conv, turn + 1)
                sched.add_seq(greedy_seq(new_id, prompts[new_id], 6))

    run.run(between=next_turns)
    assert len(run.outputs) == 24
    assert_pools_whole(sched)
    return run, sched, prompts


@pytest.mark.parametrize("num_cpu_blocks,mode", [(24, "swap"), (0, "recompute"), (24, "recompute")])
def test_multi_turn_conversations_give_the_same_tokens_cached_or_not(num_cpu_blocks, mode):
    plain, _, _ = conversation_run(False, num_cpu_blocks, mode)
    cached, sched, prompts = conversation_run(True, num_cpu_blocks, mode)
    assert cached.outputs == plain.outputs
    stats = sched.stats()
    assert stats.num_prefix_cache_hits > 0
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    hf = hf_model("tiny")
    for seq_id in (4, 14, 24):  # the last turns: the longest prompts, the most cached
        out = cached.outputs[seq_id]
        assert out == hf_greedy(hf, prompts[seq_id], len(out)), seq_id


def test_an_executor_reset_mid_run_drops_the_cache_and_changes_no_token():
    """The new executor's cache is empty (a fresh runner): every hash must be gone with it."""
    plain, _, prompts = system_prompt_run(False, 24)
    runner = make_runner(hf_model("tiny"), block_size=BLOCK_SIZE, num_gpu_blocks=40,
                         num_cpu_blocks=24)
    sched = caching_scheduler(runner, True, max_num_batched_tokens=48, max_num_seqs=12)
    rng = random.Random(7)
    system = random_prompt(rng, 22)
    for seq_id in range(1, 65):
        sched.add_seq(greedy_seq(seq_id, system + random_prompt(rng, rng.randint(1, 6)),
                                 rng.randint(2, 10)))
    run = ScheduledRun(sched, RunnerLink(runner, overlap=True))
    with pytest.raises(AssertionError, match="not finished"):
        run.run(max_steps=12)  # then the executor is lost, a step still in flight
    assert sched.block_manager.num_cached_gpu_blocks > 0
    outputs = {seq_id: list(tokens) for seq_id, tokens in run.outputs.items()}
    sched.reset_for_executor(BLOCK_SIZE, 40, 24, cache_salt=runner.info.fingerprint)
    assert sched.block_manager.num_cached_gpu_blocks == 0
    fresh = make_runner(hf_model("tiny"), block_size=BLOCK_SIZE, num_gpu_blocks=40,
                        num_cpu_blocks=24)
    rerun = ScheduledRun(sched, RunnerLink(fresh, overlap=False))
    rerun.run()
    for seq_id, tokens in rerun.outputs.items():
        outputs.setdefault(seq_id, []).extend(tokens)
    assert outputs == plain.outputs
    assert sched.stats().num_prefix_cache_hits > 0
    assert_pools_whole(sched)
