"""benchmarks/vllm_w4.py without vLLM: --dry in a plain interpreter, and its rounds against a fake
LLM that checks each round's prompts carry the previous round's outputs."""
from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from tests.benchmarks.conftest import BENCHMARKS

SMALL_FLAGS = ["--conversations", "3", "--turns", "2", "--system-tokens", "32",
               "--user-tokens", "4,8", "--output-tokens", "2,5"]


def test_dry_prints_w4_sizes_without_vllm_or_the_project(tmp_path):
    # From another folder and without PYTHONPATH, as the vLLM environment runs it.
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_w4.py"), "--dry"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, check=True)
    # W4's sizes with every output at full length (these pin the generator).
    assert ("W4: conversations=64 turns=8 requests=512 prompt_tokens=1668755 "
            "output_tokens=83051 longest_request=5115") in out.stdout


class FakeLLM:
    """Answers each prompt with made-up ids; `cached` tokens are the longest prefix shared with
    any earlier prompt, whole pages of 16 only, as a prefix cache would find."""

    def __init__(self) -> None:
        self.rounds: list[list[list[int]]] = []

    def generate(self, prompts, params, use_tqdm):
        assert use_tqdm is False and len(prompts) == len(params)
        seen = [p for r in self.rounds for p in r]
        ids = [list(p["prompt_token_ids"]) for p in prompts]
        self.rounds.append(ids)
        return [self._output(n, prompt, param, seen) for n, (prompt, param)
                in enumerate(zip(ids, params))]

    def _output(self, n, prompt, param, seen):
        assert param.kw["min_tokens"] == param.kw["max_tokens"] and param.kw["ignore_eos"]
        tokens = [len(self.rounds) * 100 + n] * param.kw["max_tokens"]
        shared = max([_common(prompt, p) for p in seen] or [0]) // 16 * 16
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)],
                               num_cached_tokens=shared,
                               metrics=SimpleNamespace(first_token_latency=0.01 * (n + 1)))


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture()
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(kw=kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def test_rounds_feed_outputs_forward_and_report_w4_figures(fake_vllm):
    import argparse

    import vllm_w4
    from conversations import make_turns

    parser = argparse.ArgumentParser()
    vllm_w4.add_arguments(parser)
    spec = vllm_w4.spec_from_args(parser.parse_args(SMALL_FLAGS))
    llm = FakeLLM()
    r = vllm_w4.run_rounds(llm, spec)
    first, second = llm.rounds
    _, conversations = make_turns(spec, vllm_w4.VOCAB)
    assert len(first) == len(second) == 3
    for n, (a, b) in enumerate(zip(first, second)):
        answer = [100 + n] * conversations[n][0].output_len  # the fake's in round 1
        assert b == a + answer + conversations[n][1].user_ids
    assert r["requests"] == 6 and r["full_outputs"] == 6
    assert r["prompt_tokens"] == sum(len(p) for p in first + second)
    assert r["prefix_cache_hits"] > 0
    assert r["prefix_cache_hit_rate"] == r["prefix_cache_hits"] / r["prompt_tokens"]
    assert r["ttft_p50_s"] == 0.02 and r["ttft_p99_s"] == 0.03 and r["ttft_count"] == 6
    assert r["output_tok_s"] > 0 and len(r["round_wall_s"]) == 2
