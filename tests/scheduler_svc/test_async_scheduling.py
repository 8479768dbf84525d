"""Async scheduling: planning step N+1 before step N's result is back gives every sequence the
same tokens as planning in lockstep, through preemption by swap and recompute and aborts."""
import random

import pytest

from sched_factories import Loop, PipelinedLoop, make_scheduler, make_seq


def workload(seed: int, n: int = 24):
    rng = random.Random(seed)
    return [(i, rng.randint(1, 40), rng.randint(1, 30)) for i in range(1, n + 1)]


def run(loop_cls, seed, num_gpu_blocks, num_cpu_blocks, eos_every=None, **loop_args):
    sched = make_scheduler(block_size=4, num_gpu_blocks=num_gpu_blocks,
                           num_cpu_blocks=num_cpu_blocks, max_num_batched_tokens=64,
                           max_num_seqs=8)
    token_fn = None
    if eos_every:  # some seqs hit EOS mid-way: the in-flight step's extra token must vanish
        token_fn = lambda seq_id, pos: 2 if (seq_id + pos) % eos_every == 0 else 100 + pos % 50
    loop = loop_cls(sched, token_fn, **loop_args) if token_fn else loop_cls(sched, **loop_args)
    for seq_id, prompt_len, max_tokens in workload(seed):
        sched.add_seq(make_seq(seq_id, prompt_len, max_tokens))
    loop.run_until_done()
    assert sched.block_manager.num_free_gpu_blocks == num_gpu_blocks
    assert sched.block_manager.num_free_cpu_blocks == num_cpu_blocks
    return loop, sched


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_cpu_blocks", [64, 0])  # swap, then recompute only
@pytest.mark.parametrize("eos_every", [None, 23])
@pytest.mark.parametrize("depth", [2, 3])  # the engine's max_steps_in_flight
def test_pipelined_outputs_equal_lockstep(seed, num_cpu_blocks, eos_every, depth):
    lockstep, _ = run(Loop, seed, 24, num_cpu_blocks, eos_every)
    pipelined, sched = run(PipelinedLoop, seed, 24, num_cpu_blocks, eos_every, depth=depth)
    assert pipelined.outputs == lockstep.outputs
    assert pipelined.finished == lockstep.finished
    assert sched.num_preemptions_swap + sched.num_preemptions_recompute > 0


def test_no_decode_is_planned_past_max_tokens():
    sched = make_scheduler(max_num_batched_tokens=64)
    loop = PipelinedLoop(sched)
    sched.add_seq(make_seq(1, prompt_len=5, max_tokens=3))
    loop.run_until_done()
    assert loop.outputs[1] and len(loop.outputs[1]) == 3
    scheduled = sum(p.num_scheduled_tokens for p in loop.plans)
    assert scheduled == 5 + 2  # the prompt, then one decode per token but the last


def four_seqs(loop_class, max_tokens: int):
    """(scheduler, loop): seqs 1 to 4, 6-token prompts, added under a 64-token step budget."""
    sched = make_scheduler(max_num_batched_tokens=64)
    loop = loop_class(sched)
    for i in range(1, 5):
        sched.add_seq(make_seq(i, prompt_len=6, max_tokens=max_tokens))
    return sched, loop


def test_abort_while_two_steps_are_in_flight():
    sched, loop = four_seqs(PipelinedLoop, max_tokens=12)
    loop.step()
    loop.step(between=lambda plan: sched.abort_seq(2))
    loop.run_until_done()
    assert 2 not in loop.finished and len(loop.outputs[1]) == 12
    assert sched.block_manager.num_free_gpu_blocks == sched.block_manager.num_gpu_blocks


def test_reset_with_steps_in_flight_recomputes_everything():
    sched, loop = four_seqs(PipelinedLoop, max_tokens=10)
    for _ in range(4):
        loop.step()
    loop.reset_executor()
    assert all(s.num_pending_tokens == 0 for s in sched.waiting)
    loop.run_until_done()
    reference, _ = run_single_lockstep()
    assert loop.outputs == reference.outputs


def run_single_lockstep():
    sched, loop = four_seqs(Loop, max_tokens=10)
    loop.run_until_done()
    return loop, sched
