"""Scheduler driven by a fake loop with hand-made sampled tokens; invariants after every step."""

import random

import pytest

from scheduler_svc.errors import ExecutorDisagreement
from scheduler_svc.plan import SeqUpdate
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import FinishReason, SequenceStatus
from sched_factories import (EOS, FakeExecutor, Loop, PipelinedLoop, default_token, make_samples,
                             make_scheduler, make_seq)


def expected_output(seq_id: int, prompt_len: int, max_tokens: int) -> list[int]:
    return [default_token(seq_id, prompt_len + k) for k in range(max_tokens)]


def run_all(sched, seqs, **loop_kw):
    loop = Loop(sched, **loop_kw)
    for seq in seqs:
        sched.add_seq(seq)
    loop.run_until_done()
    return loop


def assert_all_block_free(sched):
    bm = sched.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


# ---- basic flow ----------------------------------------------------------------------------

def test_single_seq_prefill_then_decode():
    sched = make_scheduler()
    sched.add_seq(make_seq(1, prompt_len=8, max_tokens=3))
    loop = Loop(sched)
    plan, updates = loop.step()
    assert [s.num_scheduled_tokens for s in plan.new_seqs] == [8] and not plan.cached_seqs
    assert plan.new_seqs[0].block_table == [0, 1] and plan.new_seqs[0].seed is not None
    assert [u.token_id for u in updates] == expected_output(1, 8, 1)
    plan, _ = loop.step()
    assert list(plan.cached_seqs) == [(1, 1, 8, [2])]
    loop.step()
    assert loop.finished == {1: FinishReason.LENGTH}
    assert loop.outputs[1] == expected_output(1, 8, 3)
    assert_all_block_free(sched)
    assert sched.schedule().finished_seq_ids == [1]
    assert sched.schedule().is_empty


def test_step_ids_are_consecutive_and_empty_plans_use_none():
    """The executor refuses a gap in step ids, so a plan the engine never sends (empty) must not
    use one up."""
    sched = make_scheduler()
    loop = Loop(sched)
    assert sched.schedule().is_empty and sched.schedule().is_empty
    sched.add_seq(make_seq(1, prompt_len=8, max_tokens=3))
    ids = []
    for _ in range(3):
        ids.append(loop.step()[0].step_id)
    assert ids == [1, 2, 3]
    assert loop.step()[0].finished_seq_ids == [1]  # step 4 tells the executor to drop seq 1
    assert sched.schedule().is_empty and sched.schedule().is_empty
    sched.add_seq(make_seq(2, prompt_len=4, max_tokens=1))
    assert loop.step()[0].step_id == 5


def test_seed_assigned_only_when_missing():
    sched = make_scheduler(seed=1)
    seq = make_seq(1)
    sched.add_seq(seq)
    assert isinstance(seq.seed, int)
    from dataclasses import replace
    seeded = make_seq(2)
    seeded.sampling = replace(seeded.sampling, seed=77)
    seeded.seed = 77
    sched.add_seq(seeded)
    assert seeded.seed == 77


def test_continuous_batching_new_seq_joins_decoding_one():
    sched = make_scheduler()
    loop = Loop(sched)
    sched.add_seq(make_seq(1, prompt_len=8, max_tokens=6))
    loop.step()
    loop.step()
    sched.add_seq(make_seq(2, prompt_len=5, max_tokens=3))
    plan, updates = loop.step()
    assert plan.cached_seqs.seq_ids == [1]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs] == [(2, 5)]
    assert {u.seq.seq_id for u in updates} == {1, 2}
    loop.run_until_done()
    assert loop.outputs == {1: expected_output(1, 8, 6), 2: expected_output(2, 5, 3)}
    assert_all_block_free(sched)


# ---- budget and chunked prefill ------------------------------------------------------------

def test_chunked_prefill_splits_long_prompt_and_samples_once():
    sched = make_scheduler(max_num_batched_tokens=16)
    loop = Loop(sched)
    sched.add_seq(make_seq(1, prompt_len=40, max_tokens=2))
    chunks = []
    for _ in range(3):
        plan, updates = loop.step()
        chunks.append(plan.num_scheduled_tokens)
        assert bool(updates) == (len(chunks) == 3)
    assert chunks == [16, 16, 8]
    assert plan.cached_seqs.num_computed_tokens[0] == 32
    loop.run_until_done()
    assert loop.outputs[1] == expected_output(1, 40, 2)


def test_budget_and_max_num_seqs_respected():
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=3)
    for i in range(5):
        sched.add_seq(make_seq(i, prompt_len=10, max_tokens=3))
    loop = Loop(sched)
    plan, _ = loop.step()
    assert [s.num_scheduled_tokens for s in plan.new_seqs] == [10, 10, 10]
    assert sched.num_running == 3 and sched.num_waiting == 2
    loop.run_until_done()
    assert all(len(loop.outputs[i]) == 3 for i in range(5))


def test_budget_running_decodes_first_then_prefill_chunk():
    sched = make_scheduler(max_num_batched_tokens=12)
    loop = Loop(sched)
    for i in range(2):
        sched.add_seq(make_seq(i, prompt_len=6, max_tokens=5))
    loop.step()
    sched.add_seq(make_seq(9, prompt_len=30, max_tokens=1))
    plan, _ = loop.step()
    assert plan.cached_seqs.num_scheduled_tokens == [1, 1]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs] == [(9, 10)]


def test_without_chunked_prefill_prompt_waits_for_room():
    sched = make_scheduler(max_num_batched_tokens=12, enable_chunked_prefill=False)
    loop = Loop(sched)
    sched.add_seq(make_seq(1, prompt_len=6, max_tokens=5))
    loop.step()
    sched.add_seq(make_seq(2, prompt_len=12, max_tokens=1))
    plan, _ = loop.step()
    assert not plan.new_seqs and plan.num_scheduled_tokens == 1
    loop.run_until_done()
    assert len(loop.outputs[2]) == 1


def test_without_chunked_prefill_oversized_prompt_is_chunked_rather_than_starved():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    loop = run_all(sched, [make_seq(1, prompt_len=20, max_tokens=2)])
    assert loop.outputs[1] == expected_output(1, 20, 2)


# ---- finishing and stop rules --------------------------------------------------------------

def test_finished_pages_freed_in_the_same_step():
    sched = make_scheduler()
    loop = Loop(sched)
    sched.add_seq(make_seq(1, prompt_len=8, max_tokens=1))
    sched.add_seq(make_seq(2, prompt_len=8, max_tokens=3))
    _, updates = loop.step()
    assert [(u.seq.seq_id, u.finish_reason) for u in updates] == [(1, FinishReason.LENGTH), (2, None)]
    assert sched.block_manager.get_block_table(1) == []
    assert sched.get_seq(1) is None and updates[0].seq.status is SequenceStatus.FINISHED
    plan, _ = loop.step()
    assert plan.finished_seq_ids == [1]


def eos_at(seq_id_pos: dict[int, int]):
    """Token fn that emits EOS for seq at output position (as absolute token position)."""
    def token_fn(seq_id, position):
        return EOS if seq_id_pos.get(seq_id) == position else default_token(seq_id, position)
    return token_fn


def test_eos_stops_unless_ignored_or_before_min_tokens():
    sched = make_scheduler()
    seqs = [make_seq(1, prompt_len=4, max_tokens=10),
            make_seq(2, prompt_len=4, max_tokens=10, ignore_eos=True),
            make_seq(3, prompt_len=4, max_tokens=10, min_tokens=3),
            make_seq(4, prompt_len=4, max_tokens=10, min_tokens=2)]
    loop = run_all(sched, seqs, token_fn=eos_at({1: 5, 2: 5, 3: 5, 4: 5}))
    assert loop.finished == {1: FinishReason.EOS, 2: FinishReason.LENGTH,
                             3: FinishReason.LENGTH, 4: FinishReason.EOS}
    assert len(loop.outputs[1]) == 2 and len(loop.outputs[4]) == 2


def test_stop_token_ids_after_min_tokens():
    sched = make_scheduler()
    stop = default_token(1, 5)
    seqs = [make_seq(1, prompt_len=4, max_tokens=10, stop_token_ids=(stop,))]
    loop = run_all(sched, seqs)
    assert loop.finished == {1: FinishReason.STOP_TOKEN} and loop.outputs[1][-1] == stop


def test_max_model_len_gives_length():
    sched = make_scheduler()
    loop = run_all(sched, [make_seq(1, prompt_len=6, max_tokens=None, max_model_len=9)])
    assert loop.finished == {1: FinishReason.LENGTH} and len(loop.outputs[1]) == 3


def test_gpu_pool_smaller_than_max_model_len_stops_with_length_not_deadlock():
    sched = make_scheduler(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
    loop = run_all(sched, [make_seq(1, prompt_len=10, max_tokens=None, max_model_len=100)])
    assert loop.finished == {1: FinishReason.LENGTH}
    assert 10 + len(loop.outputs[1]) == 4 * 4 + 1


def test_can_ever_fit_is_the_whole_gpu_pool():
    """The engine's admission asks it (test_engine: a hopeless request is refused)."""
    sched = make_scheduler(block_size=4, num_gpu_blocks=4)
    assert sched.can_ever_fit(16) and not sched.can_ever_fit(17)


def test_finish_seq_by_stop_string():
    sched = make_scheduler()
    loop = Loop(sched)
    sched.add_seq(make_seq(1, prompt_len=8, max_tokens=10))
    loop.step()
    assert sched.finish_seq(1, FinishReason.STOP_STRING)
    assert not sched.finish_seq(1, FinishReason.STOP_STRING)
    assert sched.block_manager.num_free_gpu_blocks == sched.block_manager.num_gpu_blocks
    plan, _ = loop.step()
    assert plan.finished_seq_ids == [1] and not sched.has_unfinished()


# ---- abort ---------------------------------------------------------------------------------

def test_abort_mid_flight_is_ignored_and_pages_freed():
    sched = make_scheduler()
    loop = Loop(sched)
    sched.add_seq(make_seq(1, prompt_len=8, max_tokens=5))
    sched.add_seq(make_seq(2, prompt_len=8, max_tokens=5))
    loop.step()
    _, updates = loop.step(between=lambda plan: sched.abort_seq(1))
    assert [u.seq.seq_id for u in updates] == [2]
    assert sched.block_manager.get_block_table(1) == []
    plan, _ = loop.step()
    assert plan.finished_seq_ids == [1] and plan.cached_seqs.seq_ids == [2]
    loop.run_until_done()
    assert loop.outputs[2] == expected_output(2, 8, 5) and len(loop.outputs[1]) == 1


def test_abort_waiting_seq_is_not_sent_to_executor():
    sched = make_scheduler()
    sched.add_seq(make_seq(1))
    assert sched.abort_seq(1) and not sched.abort_seq(1) and not sched.abort_seq(99)
    assert sched.schedule().is_empty


# ---- preemption ----------------------------------------------------------------------------

def pressure_seqs(n=4, prompt_len=8, max_tokens=12):
    return [make_seq(i, prompt_len=prompt_len, max_tokens=max_tokens) for i in range(n)]


def seqs_on_few_pages(loop_class, num_gpu_blocks: int, shapes, **config):
    """(scheduler, loop): 4-token pages, 40 CPU pages unless `config` says otherwise, and seq i
    added for each (prompt_len, max_tokens) of `shapes`."""
    sched = make_scheduler(**{"block_size": 4, "num_gpu_blocks": num_gpu_blocks,
                              "num_cpu_blocks": 40, **config})
    loop = loop_class(sched)
    for seq_id, (prompt_len, max_tokens) in enumerate(shapes):
        sched.add_seq(make_seq(seq_id, prompt_len=prompt_len, max_tokens=max_tokens))
    return sched, loop


def assert_all_finish_right(sched, loop, shapes) -> None:
    """Runs to the end: seq i of `shapes` got its expected tokens, and every page is free."""
    loop.run_until_done()
    assert loop.outputs == {i: expected_output(i, prompt_len, max_tokens)
                            for i, (prompt_len, max_tokens) in enumerate(shapes)}
    assert_all_block_free(sched)


def test_swap_preemption_round_trip_finishes_with_right_tokens():
    sched = make_scheduler(block_size=4, num_gpu_blocks=10, num_cpu_blocks=40)
    loop = run_all(sched, pressure_seqs())
    assert sched.num_preemptions_swap > 0 and sched.num_preemptions_recompute == 0
    assert sched.num_blocks_swapped_in == sched.num_blocks_swapped_out > 0
    assert any(p.swap_out for p in loop.plans) and any(p.swap_in for p in loop.plans)
    assert loop.outputs == {i: expected_output(i, 8, 12) for i in range(4)}
    assert sched.peak_gpu_blocks_used <= 10
    assert_all_block_free(sched)


def test_preempted_seq_is_resent_in_full_with_its_computed_tokens():
    sched = make_scheduler(block_size=4, num_gpu_blocks=10, num_cpu_blocks=40)
    loop = run_all(sched, pressure_seqs())
    preempted = {sid for p in loop.plans for sid in p.preempted_seq_ids}
    assert preempted
    for sid in preempted:
        resends = [s for p in loop.plans if any(x == sid for x in p.preempted_seq_ids)
                   for s in p.new_seqs if s.seq_id == sid]
        assert not resends  # never re-admitted in the step that preempted it
        news = [s for p in loop.plans for s in p.new_seqs if s.seq_id == sid]
        assert len(news) >= 2 and all(s.num_computed_tokens > 0 for s in news[1:])


def test_recompute_when_cpu_pool_is_full():
    sched = make_scheduler(block_size=4, num_gpu_blocks=10, num_cpu_blocks=0)
    loop = run_all(sched, pressure_seqs())
    assert sched.num_preemptions_recompute > 0 and sched.num_preemptions_swap == 0
    assert not any(p.swap_out or p.swap_in for p in loop.plans)
    assert loop.outputs == {i: expected_output(i, 8, 12) for i in range(4)}
    assert_all_block_free(sched)


def test_recompute_mode_never_swaps():
    sched = make_scheduler(block_size=4, num_gpu_blocks=10, num_cpu_blocks=40,
                           preemption_mode="recompute")
    loop = run_all(sched, pressure_seqs())
    assert sched.num_preemptions_recompute > 0 and sched.num_preemptions_swap == 0
    assert loop.outputs == {i: expected_output(i, 8, 12) for i in range(4)}


def test_mixed_swap_then_recompute_with_small_cpu_pool():
    sched = make_scheduler(block_size=4, num_gpu_blocks=12, num_cpu_blocks=5)
    loop = run_all(sched, pressure_seqs(n=6))
    assert sched.num_preemptions_swap > 0 and sched.num_preemptions_recompute > 0
    assert loop.outputs == {i: expected_output(i, 8, 12) for i in range(6)}
    assert_all_block_free(sched)


def test_of_requests_holding_as_many_pages_the_newest_is_the_victim():
    sched, loop = seqs_on_few_pages(Loop, 6, [(7, 12)] * 3)
    while not any(p.preempted_seq_ids for p in loop.plans):
        loop.step()
    assert loop.plans[-1].preempted_seq_ids == [2]


def preempted_ids(loop) -> list[int]:
    return [seq_id for plan in loop.plans for seq_id in plan.preempted_seq_ids]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_the_request_holding_the_most_pages_is_the_victim_not_a_small_newcomer(mode, loop_class):
    """Seq 1 holds the most pages; seq 2 (small, newest) is never preempted and finishes on
    time, seq 0 (oldest) never either; every token is right."""
    shapes = [(4, 40), (16, 30), (2, 12)]
    sched, loop = seqs_on_few_pages(loop_class, 12, shapes, preemption_mode=mode)
    for _ in range(16):
        loop.step()
    assert loop.finished.get(2) is FinishReason.LENGTH
    assert 1 in preempted_ids(loop) and not {0, 2} & set(preempted_ids(loop))
    assert_all_finish_right(sched, loop, shapes)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_wide_requests_give_up_their_samples_before_a_small_newcomer(mode, caching, loop_class):
    """Two requests of n = 4 outgrow the pool; a small request admitted after them is never the
    victim (its one page against their dozens) and finishes in its own time; a sample preempted
    by recompute finds its prompt's pages again through the prefix cache."""
    sched = make_scheduler(block_size=4, num_gpu_blocks=24, num_cpu_blocks=64,
                           preemption_mode=mode, enable_prefix_caching=caching)
    loop = loop_class(sched)
    for seq_id in (0, 10):
        seq = make_seq(seq_id, prompt_len=6, max_tokens=30)
        sched.add_seq(seq, make_samples(seq, 4, seq_id + 1))
    loop.step()
    sched.add_seq(make_seq(20, prompt_len=3, max_tokens=16))
    for _ in range(20):
        loop.step()
    assert loop.finished.get(20) is FinishReason.LENGTH
    assert preempted_ids(loop) and 20 not in preempted_ids(loop)
    loop.run_until_done()
    assert loop.outputs[20] == expected_output(20, 3, 16)
    assert all(len(tokens) == 30 for seq_id, tokens in loop.outputs.items() if seq_id != 20)
    assert_all_block_free(sched)


def test_a_requests_samples_count_their_shared_prompt_pages_once():
    """Request 1 (two samples sharing four prompt pages: seven distinct pages, eleven
    referenced) holds fewer pages than request 3 (eight): the victim is request 3's seq."""
    sched = make_scheduler(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
    loop = Loop(sched)
    sched.add_seq(make_seq(0, prompt_len=2, max_tokens=20))
    seq = make_seq(1, prompt_len=20, max_tokens=20)
    sched.add_seq(seq, make_samples(seq, 2, 2))
    sched.add_seq(make_seq(3, prompt_len=29, max_tokens=20))
    loop.step()
    loop.step()
    bm = sched.block_manager
    assert [len(bm.get_block_table(i)) for i in (1, 2, 3)] == [6, 5, 8]
    assert sched._victim().seq_id == 3
    sched.add_seq(make_seq(4, prompt_len=40, max_tokens=4))
    loop.step()  # seq 4 (ten pages) starts: now the victim, though it is the newest
    assert sched._victim().seq_id == 4


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_victim_scheduled_earlier_in_the_step_is_taken_back_out_of_the_plan(mode):
    """Seq 1, the biggest, was scheduled before seq 2 ran short in the same step: the plan drops
    it again (its tokens back in the budget) and preempts it; every token stays right."""
    shapes = [(1, 20), (17, 20), (3, 20)]
    sched, loop = seqs_on_few_pages(Loop, 9, shapes, preemption_mode=mode)
    while not any(p.preempted_seq_ids for p in loop.plans):
        loop.step()
    plan = loop.plans[-1]
    assert plan.preempted_seq_ids == [1]
    assert list(plan.cached_seqs.seq_ids) == [0, 2]
    assert plan.sampling_seq_ids == [0, 2]
    assert_all_finish_right(sched, loop, shapes)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_oldest_running_seq_is_never_preempted_unless_alone(seed, mode):
    """FCFS liveness under random pressure (requests of 1-4 samples, pipelined steps): the seq
    that is oldest when a step is planned always keeps running, so everything finishes."""
    rng = random.Random(seed)
    sched = make_scheduler(block_size=4, num_gpu_blocks=rng.randint(8, 20),
                           num_cpu_blocks=rng.choice([0, 8, 64]), preemption_mode=mode,
                           max_num_batched_tokens=rng.choice([8, 64]))
    loop = PipelinedLoop(sched)
    schedule = sched.schedule

    def checked_schedule():
        oldest = sched.running[0] if len(sched.running) > 1 else None
        plan = schedule()
        assert oldest is None or oldest.seq_id not in plan.preempted_seq_ids
        return plan

    sched.schedule = checked_schedule
    seq_id = 0
    for _ in range(8):
        seq = make_seq(seq_id, prompt_len=rng.randint(1, 12), max_tokens=rng.randint(4, 24))
        samples = make_samples(seq, rng.randint(1, 4), seq_id + 1)
        sched.add_seq(seq, samples)
        seq_id += 1 + len(samples)
        loop.step()
    loop.run_until_done()
    assert preempted_ids(loop)
    assert_all_block_free(sched)


# ---- executor loss -------------------------------------------------------------------------

PRESSURE = [(8, 12)] * 5  # five seqs that outgrow 10 GPU pages


def swapping_scheduler():
    """(scheduler, loop): the PRESSURE seqs on 10 GPU pages, stepped until one is swapped out."""
    sched, loop = seqs_on_few_pages(Loop, 10, PRESSURE)
    while not sched.swapped:
        loop.step()
    return sched, loop


def test_reset_executor_then_everything_finishes_identically():
    sched, loop = swapping_scheduler()
    stale = sched.schedule()
    loop.reset_executor()
    assert sched.update_from_output(stale, {}) == []
    assert sched.num_running == sched.num_swapped == 0 and sched.num_waiting == 5
    assert [s.seq_id for s in sched.waiting] == [0, 1, 2, 3, 4]
    plan, _ = loop.step()
    assert not plan.cached_seqs and not plan.finished_seq_ids and not plan.preempted_seq_ids
    assert all(s.num_computed_tokens == 0 for s in plan.new_seqs)
    assert_all_finish_right(sched, loop, PRESSURE)


def test_reset_for_executor_moves_every_seq_onto_new_pools_and_stats_say_so():
    sched, loop = swapping_scheduler()
    before = sched.stats()
    assert before.running + before.swapped + before.waiting == 5 and before.swapped > 0
    assert before.gpu_blocks_used == 10 - sched.block_manager.num_free_gpu_blocks > 0
    assert before.num_preemptions_swap == before.swapped and before.num_blocks_swapped_out > 0
    sched.reset_for_executor(block_size=4, num_gpu_blocks=20, num_cpu_blocks=8)
    loop.executor = FakeExecutor(4, 20, 8)
    after = sched.stats()
    assert (after.running, after.swapped, after.waiting) == (0, 0, 5)
    assert (after.gpu_blocks_used, after.gpu_blocks_total) == (0, 20)
    assert (after.cpu_blocks_used, after.cpu_blocks_total) == (0, 8)
    assert after.num_preemptions_swap == before.num_preemptions_swap  # counts run on
    assert_all_finish_right(sched, loop, PRESSURE)


def test_update_twice_is_ignored():
    sched = make_scheduler()
    loop = Loop(sched)
    sched.add_seq(make_seq(1, max_tokens=3))
    plan, _ = loop.step()
    assert sched.update_from_output(plan, {1: 5}) == []


@pytest.mark.parametrize("sampled", [{}, {1: 5, 2: 7}, {2: 7}])  # missing, extra, other
def test_disagreeing_samples_raise_before_mutating(sampled):
    sched = make_scheduler()
    sched.add_seq(make_seq(1, prompt_len=8))
    plan = sched.schedule()
    with pytest.raises(ExecutorDisagreement, match="another set of sequences"):
        sched.update_from_output(plan, sampled)
    seq = sched.get_seq(1)
    assert seq.num_output_tokens == 0 and seq.num_pending_tokens == 1


def test_token_of_a_seq_aborted_in_flight_is_no_disagreement():
    sched = make_scheduler()
    sched.add_seq(make_seq(1, prompt_len=8))
    sched.add_seq(make_seq(2, prompt_len=8))
    plan = sched.schedule()
    sched.abort_seq(2)
    updates = sched.update_from_output(plan, {1: 5, 2: 7})
    assert [u.seq.seq_id for u in updates] == [1]


# ---- the stop pre-check ----------------------------------------------------------------------
# _append_tokens checks the stop rules only for tokens that may stop a seq. It must be invisible:
# the plans and tokens of a run are those of a run with every token checked.

def _append_tokens_checking_each(self, seq_ids, sampled):
    """_append_tokens without its pre-check: every token goes through _check_stop."""
    updates = []
    for seq_id in seq_ids:
        seq, token_id = self.get_seq(seq_id), sampled[seq_id]
        if seq is None:
            continue
        seq.num_pending_tokens -= 1
        seq.token_ids.append(token_id)
        bm = self.block_manager
        if bm.enable_prefix_caching and not seq.num_tokens % bm.block_size:
            self._seqs_to_cache.add(seq_id)  # a page of known tokens completed, as _append_tokens
        reason = self._check_stop(seq, token_id)
        if reason is not None:
            self._queue_of(seq).remove(seq)
            self._finish(seq, reason)
        updates.append(SeqUpdate(seq, token_id, reason))
    return updates


def _run_mixed(loop_cls, seed: int, check_each: bool, monkeypatch):
    if check_each:
        monkeypatch.setattr(Scheduler, "_append_tokens", _append_tokens_checking_each)
    rng = random.Random(seed)
    sched = make_scheduler(block_size=4, num_gpu_blocks=20, num_cpu_blocks=rng.choice([0, 16]),
                           max_num_batched_tokens=rng.choice([8, 24, 64]), max_num_seqs=6)
    eos_every = rng.choice([None, 13])
    loop = loop_cls(sched, lambda s, p: EOS if eos_every and (s + p) % eos_every == 0
                    else default_token(s, p))
    for seq_id in range(1, 17):
        seq = make_seq(seq_id, rng.randint(1, 30), rng.choice([None, rng.randint(1, 25)]),
                       max_model_len=rng.randint(31, 100), min_tokens=rng.choice([0, 2]),
                       stop_token_ids=rng.choice([(), (default_token(seq_id, 33),)]))
        sched.add_seq(seq)
    for _ in range(400):
        if not sched.has_unfinished() and not getattr(loop, "in_flight", None):
            break
        loop.step()
    monkeypatch.undo()
    return loop


@pytest.mark.parametrize("loop_cls", [Loop, PipelinedLoop])
@pytest.mark.parametrize("seed", range(6))
def test_the_stop_precheck_plans_and_stops_as_checking_every_token(loop_cls, seed, monkeypatch):
    fast = _run_mixed(loop_cls, seed, False, monkeypatch)
    general = _run_mixed(loop_cls, seed, True, monkeypatch)
    assert fast.plans == general.plans
    assert fast.outputs == general.outputs and fast.finished == general.finished
    assert sum(len(p.cached_seqs) for p in fast.plans) > 50


# ---- prefix caching ------------------------------------------------------------------------

def _seq_with_prompt(seq_id, prompt, max_tokens=3):
    from scheduler_svc.sampling_params import SamplingParams, StoppingParams
    from scheduler_svc.sequence import Sequence
    return Sequence(seq_id, prompt, SamplingParams(), StoppingParams(max_tokens=max_tokens),
                    eos_token_id=EOS, max_model_len=4096, arrival_time=float(seq_id))


SYSTEM = [300 + i for i in range(10)]  # two full pages of 4 and a partial one


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_a_later_request_with_the_same_prefix_starts_after_the_cached_pages(loop_class):
    sched = make_scheduler(block_size=4)
    loop = loop_class(sched)
    sched.add_seq(_seq_with_prompt(1, SYSTEM + [1, 2]))
    loop.run_until_done()
    first_table = loop.plans[0].new_seqs[0].block_table
    sched.add_seq(_seq_with_prompt(2, SYSTEM + [5, 6, 7]))
    plan, _ = loop.step()
    (new,) = plan.new_seqs
    assert new.num_computed_tokens == 8 and new.num_scheduled_tokens == 13 - 8
    assert new.block_table[:2] == first_table[:2] and new.block_table[2] != first_table[2]
    loop.run_until_done()
    assert loop.outputs[2] == expected_output(2, 13, 3)  # the FakeExecutor checked the KV
    stats = sched.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (12 + 13, 8)
    assert stats.gpu_blocks_cached >= 3  # seq 1's three full pages (prompt + outputs)
    assert_all_block_free(sched)


def test_pages_are_offered_to_the_cache_only_once_a_sent_step_writes_them():
    sched = make_scheduler(block_size=4)
    sched.add_seq(_seq_with_prompt(1, SYSTEM + [1, 2]))
    sched.add_seq(_seq_with_prompt(2, SYSTEM + [3, 4]))
    plan = sched.schedule()  # both in one step: the second cannot use pages the first writes
    assert [s.num_computed_tokens for s in plan.new_seqs] == [0, 0]
    assert sched.block_manager.num_cached_gpu_blocks == 0
    sched.update_from_output(plan, {1: 100, 2: 100})
    sched.add_seq(_seq_with_prompt(3, SYSTEM + [5]))
    plan = sched.schedule()
    (new,) = plan.new_seqs
    assert new.num_computed_tokens == 8


def test_a_whole_cached_prompt_still_computes_its_last_token():
    sched = make_scheduler(block_size=4)
    loop = Loop(sched)
    sched.add_seq(_seq_with_prompt(1, SYSTEM[:8], max_tokens=1))
    loop.run_until_done()
    sched.add_seq(_seq_with_prompt(2, SYSTEM[:8], max_tokens=2))
    plan, _ = loop.step()
    (new,) = plan.new_seqs
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (4, 4)  # a page, not 7 tokens
    loop.run_until_done()
    assert loop.outputs[2] == expected_output(2, 8, 2)


def test_multi_turn_conversation_hits_the_previous_turns_pages():
    sched = make_scheduler(block_size=4)
    loop = Loop(sched)
    prompt, num_computed_before = list(SYSTEM), 0
    for turn in range(1, 5):
        sched.add_seq(_seq_with_prompt(turn, prompt, max_tokens=6))
        plan, _ = loop.step()
        (new,) = plan.new_seqs
        # Every full page the previous turn computed (all its tokens but the last sampled one).
        assert new.num_computed_tokens == num_computed_before // 4 * 4
        loop.run_until_done()
        num_computed_before = len(prompt) + 6 - 1
        prompt = prompt + loop.outputs[turn] + [400 + turn, 401 + turn]
    assert sched.stats().num_prefix_cache_hits > 0
    assert_all_block_free(sched)


def test_executor_reset_drops_the_prefix_cache():
    sched = make_scheduler(block_size=4)
    loop = Loop(sched)
    sched.add_seq(_seq_with_prompt(1, SYSTEM))
    loop.run_until_done()
    assert sched.block_manager.num_cached_gpu_blocks > 0
    loop.reset_executor()
    assert sched.block_manager.num_cached_gpu_blocks == 0
    sched.reset_for_executor(4, 64, 64, cache_salt="another")
    assert sched.block_manager.enable_prefix_caching
    sched.add_seq(_seq_with_prompt(2, SYSTEM + [1]))
    loop.executor = FakeExecutor(4, 64, 64)
    plan, _ = loop.step()
    assert plan.new_seqs[0].num_computed_tokens == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_shared_prefixes_under_preemption_give_the_same_tokens_and_whole_pools(mode, loop_class):
    outputs = {}
    for caching in (False, True):
        sched = make_scheduler(block_size=4, num_gpu_blocks=14, num_cpu_blocks=40,
                               preemption_mode=mode, enable_prefix_caching=caching)
        loop = loop_class(sched)
        for seq_id in range(12):
            sched.add_seq(_seq_with_prompt(seq_id, SYSTEM + [seq_id, seq_id + 1], max_tokens=12))
        loop.run_until_done()
        assert sched.num_preemptions_swap + sched.num_preemptions_recompute > 0
        assert_all_block_free(sched)
        outputs[caching] = loop.outputs
        hits = sched.stats().num_prefix_cache_hits
        assert (hits > 0) == caching
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
def test_decoding_seqs_are_offered_to_the_cache_once_a_page_not_every_step(loop_class):
    sched = make_scheduler(block_size=4)
    loop = loop_class(sched)
    calls = []
    offer = sched.block_manager.cache_full_blocks
    sched.block_manager.cache_full_blocks = lambda *a: (calls.append(a[0]), offer(*a))
    for seq_id in range(4):
        sched.add_seq(make_seq(seq_id, prompt_len=8, max_tokens=24))
    loop.run_until_done()
    assert loop.outputs == {i: expected_output(i, 8, 24) for i in range(4)}
    # At most two offers a page filled (lockstep: when its last token is known, and once its KV
    # is), not one a token (96).
    assert len(calls) <= 4 * (2 * 24 // 4 + 3)
    assert sched.block_manager.num_cached_gpu_blocks == 4 * ((8 + 24 - 1) // 4)


def _shared_prefix_workload(sched, n):
    """Eight requests whose prompts start with SYSTEM, half of them of n samples."""
    from sched_factories import make_samples
    ids = []
    for r in range(8):
        seq = _seq_with_prompt(r + 1, SYSTEM + [r, r + 1, r + 2], max_tokens=14)
        samples = make_samples(seq, n if r % 2 else 1, 100 * (r + 1))
        sched.add_seq(seq, samples)
        ids += [seq.seq_id, *(s.seq_id for s in samples)]
    return ids


@pytest.mark.parametrize("loop_class", [Loop, PipelinedLoop])
@pytest.mark.parametrize("caching", [True, False])
def test_swapping_shared_pages_gives_the_tokens_of_no_preemption_and_copies_each_once(
        loop_class, caching):
    """Prompts with a common prefix (prefix caching) and parallel samples (forks, caching on or
    off) under swap preemption: the tokens of a pool too big to preempt; the shared pages moved
    by sharing rather than by a copy per seq (the FakeExecutor checks the KV of every page)."""
    outputs, stats = {}, {}
    for num_gpu_blocks in (256, 16):
        sched = make_scheduler(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64,
                               max_num_batched_tokens=32, enable_prefix_caching=caching)
        ids = _shared_prefix_workload(sched, n=3)
        loop = loop_class(sched)
        loop.run_until_done()
        assert_all_block_free(sched)
        outputs[num_gpu_blocks] = [loop.outputs[i] for i in ids]
        stats[num_gpu_blocks] = sched.stats()
        loop.reset_executor()  # the executor's KV is gone: no hash survives on either device
        assert sched.stats().gpu_blocks_cached == sched.stats().cpu_blocks_cached == 0
    assert outputs[16] == outputs[256]
    assert stats[256].num_preemptions_swap == 0
    q = stats[16]
    assert q.num_preemptions_swap > 0 and q.num_preemptions_recompute == 0
    assert q.num_blocks_swap_shared_out > 0 and q.num_blocks_swap_shared_in > 0
    assert (q.cpu_blocks_cached > 0) == caching
