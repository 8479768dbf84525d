"""Step limits between real processes, on their real commands: the executor's ready line says what
it recommends and why, and the scheduler takes what its flags leave unset from it, saying so."""
from __future__ import annotations

import grpc
import pytest

from tests.integration.harness import attach_scheduler, generate

pytestmark = pytest.mark.slow


def test_the_scheduler_takes_unset_limits_from_the_executor_and_its_flag_wins(tmp_path,
                                                                               tiny_executor):
    with attach_scheduler(tmp_path, tiny_executor, ["--max-num-seqs", "8"]) as services:
        with grpc.insecure_channel(services.scheduler_address) as channel:
            ids, _, _ = generate(services.stub(channel), [5, 6, 7], max_tokens=4)
        assert len(ids) == 4
        executor, scheduler = services.log_of("executor"), services.log_of("scheduler")
    ready = next(line for line in executor.splitlines() if "executor ready on" in line)
    assert ("recommends 2048 tokens and 128 seqs a step (vLLM's rule for CPU, " in ready
            and "advice: no profile)" in ready), ready
    chose = next(line for line in scheduler.splitlines() if "step limits with executor" in line)
    assert f"step limits with executor {services.executor_address}: 2048 tokens (from the " \
        "executor: vLLM's rule for CPU, " in chose, chose
    assert "8 seqs (--max-num-seqs; the executor recommends 128) a step; no CUDA graphs" in chose
