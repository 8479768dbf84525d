"""bench_executor_host drives a real ModelRunner with the real scheduler's plans: decode steps go
through the decode-graph path, mixed ones eagerly, and the runner's state follows the
scheduler's; the prefix case admits one cached-prefix seq a step through the small-step graphs."""
from __future__ import annotations

import pytest

from benchmarks.bench_executor_host import (NEW_TOKENS, PHASES, PREFIX_TOKENS, Bench,
                                            PrefixBench, run_case)
from tests.executor_svc.helpers import held_tokens


@pytest.mark.parametrize("case, kind", [("decode", "decode"), ("mixed", "other")])
def test_run_case_reports_every_phase_of_the_expected_step_kind(case, kind):
    result = run_case(case, num_seqs=8, steps=6, seed=1)
    assert set(result["phases"]) == {*PHASES, "sum"}
    assert result["step_kinds"][kind] == 6 and result["running_at_end"] == 8
    assert all(p["median_ms"] > 0 for p in result["phases"].values())


def test_the_runner_holds_what_the_scheduler_holds():
    bench = Bench(num_seqs=6, finish_per_step=1, seed=2)
    for _ in range(8):
        bench.step()
    while bench.in_flight:  # finish what is in flight so that both sides know every token
        _, pending = bench.in_flight.popleft()
        bench.runner.finish(pending)
    for seq in bench.sched.running:
        held = held_tokens(bench.runner, seq.seq_id).tolist()
        assert held[:len(seq.token_ids)] == seq.token_ids


def test_the_prefix_case_admits_one_cached_prefix_seq_a_step_through_the_small_step_graphs():
    bench = PrefixBench(num_seqs=1, finish_per_step=0, seed=3)
    graphs = bench.runner.graphs
    num_runs = []
    run = graphs.run

    def counting_run(inputs, sampling=None, *args):
        if not inputs.is_decode:
            num_runs.append(len(inputs.input_ids))
        return run(inputs, sampling, *args)
    graphs.run = counting_run
    for _ in range(5):
        plan, _ = bench.in_flight[0]
        bench.step()
        (new,) = plan.new_seqs
        assert (new.num_computed_tokens, new.num_scheduled_tokens) == (PREFIX_TOKENS, NEW_TOKENS)
    assert num_runs == [NEW_TOKENS] * 5
    assert len(bench.runner.input_batch) == 1  # each seq dropped by the plan after its one token
    result = run_case("prefix", num_seqs=1, steps=4, seed=1)
    assert result["step_kinds"]["other"] == 4 and result["running_at_end"] == 1
    assert 0 < result["phases"]["to_replay"]["median_ms"] < result["phases"]["launch"]["median_ms"]
