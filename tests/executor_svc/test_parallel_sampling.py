"""Parallel sampling end to end on the CPU runner (issue 12): the real scheduler, two steps in
flight or lockstep, forks a request's samples from its first sample's prompt pages, the partial
last page copied by the executor's copy_blocks before the forward. n = 4 greedy gives what four
separate requests give (and transformers); n = 4 sampled with a seed is reproducible, each
sample what a separate request seeded seed + i gives; preemption by swap or recompute leaves the
other samples intact; every page is free at the end."""
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
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)


def scheduler(runner, caching=True, **config) -> Scheduler:
    info = runner.info
    bm = BlockManager(info.block_size, info.num_gpu_blocks, info.num_cpu_blocks,
                      enable_prefix_caching=caching, cache_salt=info.fingerprint)
    return Scheduler(SchedulerConfig(enable_prefix_caching=caching, **config), bm,
                     rng=random.Random(0))


def seqs_of(first_id: int, prompt, n: int, max_tokens: int, sampling=SamplingParams(),
            seed: int | None = None) -> list[Sequence]:
    """A request's n samples, seeded as the engine seeds them (seed + i)."""
    seqs = [Sequence(first_id + i, prompt, sampling, StoppingParams(max_tokens=max_tokens),
                     eos_token_id=None, max_model_len=512, arrival_time=float(first_id))
            for i in range(n)]
    if seed is not None:
        for i, seq in enumerate(seqs):
            seq.seed = seed + i
    return seqs


def assert_pools_whole(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


def run(requests, *, parallel: bool, overlap: bool = True, num_gpu_blocks: int = 64,
        num_cpu_blocks: int = 32, caching: bool = True, **config):
    """requests: lists of samples. parallel: each list is one request with n samples; else
    every sample is a request of its own. Returns {seq_id: tokens} and the scheduler."""
    runner = make_runner(hf_model("tiny"), block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks,
                         num_cpu_blocks=num_cpu_blocks)
    sched = scheduler(runner, caching, **config)
    for samples in requests:
        if parallel:
            sched.add_seq(samples[0], samples[1:])
        else:
            for seq in samples:
                sched.add_seq(seq)
    outputs = ScheduledRun(sched, RunnerLink(runner, overlap)).run().outputs
    assert_pools_whole(sched)
    return outputs, sched


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prompt_len", [9, 10, 12])  # last prompt token: page start, mid, end
def test_n4_greedy_equals_four_separate_requests(overlap, prompt_len):
    prompt = random_prompt(random.Random(prompt_len), prompt_len)
    forked, sched = run([seqs_of(1, prompt, 4, 8)], parallel=True, overlap=overlap)
    separate, _ = run([seqs_of(1, prompt, 4, 8)], parallel=False, overlap=overlap,
                      caching=False)
    assert [forked[i] for i in range(1, 5)] == [separate[i] for i in range(1, 5)]
    assert forked[1] == hf_greedy(hf_model("tiny"), prompt, 8)
    # the prompt's page holding its last token is copied for each sample after the first
    assert sched.stats().num_blocks_copied == (3 if (prompt_len - 1) % BLOCK_SIZE else 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_n4_sampled_with_a_seed_is_reproducible_and_each_sample_its_own(overlap):
    prompt = random_prompt(random.Random(5), 10)

    def sampled(parallel):
        return run([seqs_of(1, prompt, 4, 10, SAMPLED, seed=1234)], parallel=parallel,
                   overlap=overlap)[0]
    first = sampled(True)
    assert sampled(True) == first
    assert len({tuple(first[i]) for i in range(1, 5)}) == 4  # distinct samples
    assert first == sampled(False)  # sample i is a request seeded 1234 + i


@pytest.mark.parametrize("num_cpu_blocks", [24, 0])  # preemption by swap, then by recompute
def test_preempted_samples_leave_the_others_intact(num_cpu_blocks):
    rng = random.Random(11)
    prompts = [random_prompt(rng, rng.randint(5, 14)) for _ in range(4)]

    def requests():
        return [seqs_of(10 * r + 1, p, 3, 14) for r, p in enumerate(prompts)]
    forked, sched = run(requests(), parallel=True, num_gpu_blocks=20,
                        num_cpu_blocks=num_cpu_blocks, max_num_batched_tokens=32)
    stats = sched.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    separate, _ = run(requests(), parallel=False, caching=False)
    assert forked == separate
