"""bench_streams end to end (real engine, gRPC server and streaming clients over the simulated GPU):
every token reaches its stream at both stream intervals, and the simulated GPU accounts for every
step."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.conftest import BENCHMARKS

pytestmark = pytest.mark.slow


def test_every_token_streamed_and_every_step_simulated(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_streams.py"), "--streams", "300",
                    "--stream-interval", "1", "0", "--max-tokens", "12", "--prompt-len", "20",
                    "--json", str(out)], check=True, timeout=240, cwd=tmp_path)
    rows = json.loads(out.read_text())
    assert [(r["streams"], r["stream_interval"]) for r in rows] == [(300, 1), (300, 0)]
    for row in rows:
        assert row["tokens"] == row["expected_tokens"] == 300 * 12
        # one prefill step at least, then one step per further token
        assert row["steps"] >= 12 and row["gpu_busy_s"] > 0
        assert 0 <= row["gpu_idle_frac"] < 1
        assert 0 < row["loop_cpu_ms_per_step"] <= row["process_cpu_ms_per_step"]
