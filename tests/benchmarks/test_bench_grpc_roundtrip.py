"""bench_grpc_roundtrip end to end: both echo servers answer every plan with its own step's
result, in order (the benchmark raises otherwise), and a line per server kind comes out."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.benchmarks.conftest import BENCHMARKS


def test_both_servers_echo_every_step_in_order(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_grpc_roundtrip.py"),
                           "--round-trips", "30", "--warmup", "3"], check=True, timeout=120,
                          cwd=tmp_path, capture_output=True, text=True)
    lines = re.findall(r"^(.+): 30 round trips, median (\d+\.\d+) ms", done.stdout, re.MULTILINE)
    assert [name for name, _ in lines] == [
        "sync server (the executor's kind)", "grpc.aio server",
        "the executor's options, reader thread and pipeline"]
    assert all(float(ms) > 0 for _, ms in lines)
