"""bench_serving's W4 (scaled down) and prefix-ttft end to end on the CPU backend with the tiny
preset (real processes), and side_by_side's table read back from their JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import bench_serving
from benchmarks.conversations import ConversationsSpec, turn_lengths
from tests.benchmarks.conftest import BENCHMARKS

pytestmark = pytest.mark.slow

TINY = ["--backend", "cpu", "--model", "preset:tiny", "--swap-space", "0.01",
        "--max-num-batched-tokens", "2048"]
SPEC = ConversationsSpec(conversations=4, turns=3, system_tokens=64, user_tokens=(8, 16),
                         output_tokens=(4, 8))
W4_FLAGS = ["--conversations", "4", "--turns", "3", "--system-tokens", "64",
            "--user-tokens", "8,16", "--output-tokens", "4,8"]
VOCAB = 49152  # the tiny preset's
PAGE = 16


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("side_by_side")


@pytest.fixture(scope="module")
def w4(out_dir):
    path = out_dir / "pagedserve_W4.json"
    bench_serving.main(["--workload", "W4", *W4_FLAGS, *TINY, "--out", str(path),
                        "--log-dir", str(out_dir / "logs")])
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def prefix_ttft(out_dir):
    path = out_dir / "pagedserve_prefix-ttft.json"
    bench_serving.main(["--workload", "prefix-ttft", "--system-tokens", "256",
                        "--num-requests", "3", *TINY, "--out", str(path)])
    return json.loads(path.read_text())


def test_w4_runs_every_turn_with_the_prefix_cache(w4):
    r = w4["serving"]
    lengths = [turn for row in turn_lengths(SPEC, VOCAB) for turn in row]
    assert r["requests"] == r["complete"] == 12 and not r["timed_out"] and not r["errors"]
    assert r["rounds_done"] == r["turns"] == 3 and len(r["round_wall_s"]) == 3
    assert r["output_tokens"] == r["expected_output_tokens"] == sum(o for _, o in lengths)
    assert r["output_tok_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert r["prefix_cache_queries"] == sum(p for p, _ in lengths)
    # A later turn finds the whole previous turn cached (its last output token was never fed
    # back): only so if its prompt holds the tokens the model actually generated.
    fed_back = sum((prompt + output - 1) // PAGE * PAGE
                   for row in turn_lengths(SPEC, VOCAB) for prompt, output in row[:-1])
    assert r["prefix_cache_hits"] >= fed_back
    assert r["prefix_cache_hit_rate"] == r["prefix_cache_hits"] / r["prefix_cache_queries"]
    assert w4["hf"] is None


def test_prefix_ttft_with_caching_on_and_off(prefix_ttft):
    r = prefix_ttft["serving"]
    assert r["requests"] == 3 and r["prefix_tokens"] == 256 and r["new_tokens"] == 16
    on, off = r["cached"], r["uncached"]
    assert not on["errors"] and not off["errors"]
    assert len(on["ttft_s"]) == len(off["ttft_s"]) == 3
    assert on["prefix_cache_hit_rate"] == 256 / 272  # every timed request finds the prefix
    assert off["prefix_cache_hits"] == 0 and off["prefix_cache_hit_rate"] == 0
    assert r["ratio"] == off["ttft_p50_s"] / on["ttft_p50_s"] > 0


def test_side_by_side_reads_them_back(w4, prefix_ttft, out_dir):
    vllm_w4 = {"vllm": "0.26.0", "gpu": "fake", "workloads": {"W4": {
        "requests": 12, "full_outputs": 12, "output_tok_s": w4["serving"]["output_tok_s"] / 2,
        "ttft_p50_s": 0.5, "ttft_p99_s": 0.75, "prefix_cache_hit_rate": 0.25}}}
    (out_dir / "vllm_W4.json").write_text(json.dumps(vllm_w4))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "side_by_side.py"), "--from-dir",
                          str(out_dir), "--workloads", "W4", "--prefix-ttft"],
                         capture_output=True, text=True, check=True).stdout
    assert "| W4 | " in out and "| 2.00x |" in out and "12/12, 12/12" in out
    assert "vLLM 0.50 s / 0.75 s; prefix cache hit rate pagedserve " in out and "vLLM 25.0%" in out
    assert f"ratio {prefix_ttft['serving']['ratio']:.1f}x" in out
