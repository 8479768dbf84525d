"""bench_executor_host drives a real ModelRunner with the real scheduler's plans: decode steps go
through the decode-graph path, mixed ones eagerly, and the runner's state follows the
scheduler's."""
from __future__ import annotations

import pytest

from benchmarks.bench_executor_host import PHASES, Bench, run_case


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
        held = bench.runner.token_ids(seq.seq_id).tolist()
        assert held[:len(seq.token_ids)] == seq.token_ids
