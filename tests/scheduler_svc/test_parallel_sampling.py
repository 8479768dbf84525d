"""Parallel sampling in the scheduler: a request's samples prefill once and fork from the first
sample's pages (full pages shared, the partial last one copied through the plan's `copy`), under
lockstep and async scheduling, preemption by swap and recompute, aborts and executor resets."""
import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import FinishReason
from sched_factories import (Loop, PipelinedLoop, make_samples, make_scheduler, make_seq)


def same_for_all(seq_id, position):
    """Greedy: every sample of a prompt gets the same token."""
    return 100 + (position * 31) % 97


def add_request(sched, seq_id, n, prompt_len=10, max_tokens=6, **kw):
    seq = make_seq(seq_id, prompt_len, max_tokens, **kw)
    samples = make_samples(seq, n, 100 * seq_id)
    sched.add_seq(seq, samples)
    return [seq.seq_id, *(s.seq_id for s in samples)]


def assert_pools_whole(sched):
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


# ---- block manager ----------------------------------------------------------------------------

def test_fork_prompt_shares_full_pages_and_copies_the_partial_one():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    bm.allocate_slots(1, 11)  # blocks [0, 1, 2]; tokens 0..9 of the prompt, and one decoded
    copies = []
    assert bm.fork_prompt(1, 2, 10, copies)  # the child recomputes token 9, in page 2
    assert bm.get_block_table(2) == [0, 1, 3] and copies == [(2, 3)]
    bm.check_invariants()
    assert bm.allocate_slots(1, 12) == [] and bm.allocate_slots(2, 12) == []  # no copies
    bm.free(1)
    assert bm.num_free_gpu_blocks == 5  # pages 0 and 1 are still the child's, and 3
    bm.free(2)
    assert bm.num_free_gpu_blocks == 8
    bm.check_invariants()


def test_fork_prompt_whose_last_token_starts_a_page_copies_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    bm.allocate_slots(1, 9)
    copies = []
    assert bm.fork_prompt(1, 2, 9, copies)
    assert bm.get_block_table(2) == [0, 1, 3] and copies == []
    bm.check_invariants()


def test_fork_prompt_needs_one_free_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0)
    bm.allocate_slots(1, 10)
    copies = []
    assert not bm.fork_prompt(1, 2, 10, copies)
    assert copies == [] and bm.get_block_table(2) == []
    bm.check_invariants()


# ---- scheduler --------------------------------------------------------------------------------

@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_samples_fork_in_the_plan_after_the_prefill(loop_class):
    sched = make_scheduler(block_size=4)
    ids = add_request(sched, 1, 4, prompt_len=10)
    loop = loop_class(sched, same_for_all)
    assert sched.stats().waiting == 4  # the first sample queued, the others waiting to fork
    first, _ = loop.step()
    assert [s.seq_id for s in first.new_seqs] == [1] and not first.copy
    second = loop.plans[1] if loop_class is PipelinedLoop else loop.step()[0]
    parent_table = sched.block_manager.get_block_table(1)
    assert [s.seq_id for s in second.new_seqs] == ids[1:]
    assert [(s.num_computed_tokens, s.num_scheduled_tokens) for s in second.new_seqs] == \
        [(9, 1)] * 3
    assert [src for src, _ in second.copy] == [parent_table[2]] * 3
    for s, (_, dst) in zip(second.new_seqs, second.copy):
        assert s.block_table == parent_table[:2] + [dst]
    assert sched.num_blocks_copied == 3
    loop.run_until_done()
    assert all(loop.outputs[i] == loop.outputs[1] for i in ids)
    assert_pools_whole(sched)


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
@pytest.mark.parametrize("prompt_len", [1, 4, 9, 10])
def test_n_samples_give_what_separate_requests_give(loop_class, prompt_len):
    """Greedy (the token depends on the position only): n = 4 samples equal four requests."""
    sched = make_scheduler(block_size=4)
    ids = add_request(sched, 1, 4, prompt_len=prompt_len, max_tokens=7)
    loop = loop_class(sched, same_for_all)
    loop.run_until_done()
    alone = make_scheduler(block_size=4)
    alone.add_seq(make_seq(1, prompt_len, 7))
    reference = loop_class(alone, same_for_all)
    reference.run_until_done()
    assert [loop.outputs[i] for i in ids] == [reference.outputs[1]] * 4
    assert_pools_whole(sched)


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_each_sample_samples_its_own_tokens(loop_class):
    """Sampled: the fake sampler depends on the seq, so samples differ, and a rerun repeats."""
    def run():
        sched = make_scheduler(block_size=4)
        ids = add_request(sched, 1, 4, prompt_len=10, max_tokens=5)
        loop = loop_class(sched)
        loop.run_until_done()
        assert_pools_whole(sched)
        return [loop.outputs[i] for i in ids]
    outputs = run()
    assert len({tuple(o) for o in outputs}) == 4 and run() == outputs


def test_samples_get_distinct_seeds_and_keep_given_ones():
    sched = make_scheduler()
    seq = make_seq(1)
    samples = make_samples(seq, 4, 10)
    samples[0].seed = 7
    sched.add_seq(seq, samples)
    assert samples[0].seed == 7
    assert len({s.seed for s in (seq, *samples)}) == 4


def started_request(loop_class, n: int, max_tokens: int, steps: int):
    """(scheduler, loop, seq ids): request 1 with `n` samples of a 10-token prompt on 4-token
    pages, after `steps` steps."""
    sched = make_scheduler(block_size=4)
    ids = add_request(sched, 1, n, prompt_len=10, max_tokens=max_tokens)
    loop = loop_class(sched, same_for_all)
    for _ in range(steps):
        loop.step()
    return sched, loop, ids


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_a_first_sample_done_before_the_fork_leaves_the_others_to_prefill(loop_class):
    sched, loop, ids = started_request(loop_class, 3, max_tokens=1, steps=0)
    loop.run_until_done()
    assert [loop.outputs[i] for i in ids] == [loop.outputs[1]] * 3
    assert all(loop.finished[i] is FinishReason.LENGTH for i in ids)
    assert_pools_whole(sched)


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_aborting_every_sample_frees_every_page(loop_class):
    sched, loop, ids = started_request(loop_class, 4, max_tokens=50, steps=4)
    for seq_id in ids:
        assert sched.abort_seq(seq_id)
    loop.run_until_done()
    assert_pools_whole(sched)
    assert not sched.has_unfinished()


def test_aborting_samples_before_they_fork():
    sched = make_scheduler(block_size=4)
    ids = add_request(sched, 1, 4, prompt_len=10, max_tokens=5)
    assert sched.abort_seq(ids[2])
    loop = Loop(sched, same_for_all)
    loop.step()
    assert sched.abort_seq(ids[0])  # the first sample: the others prefill on their own
    loop.run_until_done()
    assert sorted(loop.outputs) == [1, ids[1], ids[3]] and len(loop.outputs[1]) == 1
    assert loop.outputs[ids[1]] == loop.outputs[ids[3]] and len(loop.outputs[ids[3]]) == 5
    assert_pools_whole(sched)


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
@pytest.mark.parametrize("num_cpu_blocks", [64, 0])  # preemption by swap, then by recompute
@pytest.mark.parametrize("caching", [True, False])
def test_preempting_samples_leaves_the_others_intact(loop_class, num_cpu_blocks, caching):
    def run(n):
        sched = make_scheduler(block_size=4, num_gpu_blocks=14, num_cpu_blocks=num_cpu_blocks,
                               max_num_batched_tokens=32, enable_prefix_caching=caching)
        requests = [add_request(sched, r, n, prompt_len=6 + 3 * r, max_tokens=12)
                    for r in (1, 2, 3)]
        loop = loop_class(sched, same_for_all)
        loop.run_until_done()
        assert_pools_whole(sched)
        return sched, [[loop.outputs[i] for i in ids] for ids in requests]
    sched, outputs = run(3)
    assert sched.num_preemptions_swap + sched.num_preemptions_recompute > 0
    assert outputs == [[o[0]] * 3 for o in run(1)[1]]


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_executor_reset_with_samples_waiting_and_forked(loop_class):
    sched, loop, first = started_request(loop_class, 3, max_tokens=8, steps=3)
    second = add_request(sched, 2, 3, prompt_len=7, max_tokens=8)
    loop.step()
    loop.reset_executor()
    loop.run_until_done()
    assert [loop.outputs[i] for i in first] == [loop.outputs[1]] * 3
    assert [loop.outputs[i] for i in second] == [loop.outputs[2]] * 3
    assert_pools_whole(sched)
