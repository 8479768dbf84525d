"""bench_wire end to end, this tree against itself: a line per case, for both trees, with the
same encoded sizes (the same code encodes the same inputs)."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.benchmarks.conftest import BENCHMARKS


def test_every_case_is_measured_on_both_trees(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_wire.py"), "--num-seqs", "1",
                           "8", "--rounds", "1", "--repeats", "1", "--against",
                           str(BENCHMARKS.parent)], check=True, timeout=120, cwd=tmp_path,
                          capture_output=True, text=True)
    lines = re.findall(r"^(\w+ \d+(?: \+logprobs)?) +([\d.]+) +([\d.]+) +([\d.]+) +(\d+) +\| +"
                       r"([\d.]+) +([\d.]+) +([\d.]+) +(\d+)$", done.stdout, re.MULTILINE)
    assert [line[0] for line in lines] == [
        "result 1", "result 1 +logprobs", "plan 1", "result 8", "result 8 +logprobs", "plan 8"]
    for line in lines:
        assert line[4] == line[8] and all(float(v) > 0 for v in line[1:])
