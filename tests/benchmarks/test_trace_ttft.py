"""trace_ttft: the breakdown of synthetic marks, and a real run through both services whose
trace points all install (a renamed function on the request's path fails here)."""
from __future__ import annotations

import subprocess
import sys

from benchmarks.trace_ttft import breakdown
from tests.benchmarks.conftest import BENCHMARKS


def test_breakdown_takes_each_requests_first_marks_and_medians_the_gaps():
    marks = []
    for i, (a, b, c) in enumerate([(0, 10, 30), (100, 130, 140), (200, 220, 260)]):
        marks += [(a * 1000, "C.send"), (b * 1000, "S.spec>"), (b * 1000 + 500, "S.spec>"),
                  (c * 1000, "C.first")]
    rows, ttft = breakdown(sorted(marks), skip=0)
    assert rows == [("C.send", "S.spec>", 20.0, 3), ("S.spec>", "C.first", 20.0, 3)]
    assert ttft == 40.0
    rows, ttft = breakdown(sorted(marks), skip=1)  # the first request left out
    assert ttft == 50.0 and rows[0] == ("C.send", "S.spec>", 25.0, 2)


def test_a_run_through_both_services_marks_the_whole_path(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.trace_ttft", "--requests", "20",
                           "--warmup", "2", "--prefix-tokens", "64"], check=True, timeout=240,
                          cwd=BENCHMARKS.parent, capture_output=True, text=True)
    pairs = [line.split()[:3] for line in done.stdout.splitlines()[1:]]
    labels = {p[0] for p in pairs} | {p[2] for p in pairs}
    for label in ("C.send", "S.spec>", "S.schedule<", "S.send<", "E.launch>", "E.encode<",
                  "S.receive<", "S.emit_step>", "S.events_to_protos<", "C.first"):
        assert label in labels, (label, done.stdout)
