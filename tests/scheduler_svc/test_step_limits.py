"""The scheduler's step limits: a flag given wins, an unset one takes the executor's recommendation
(and keeps it for a replacement recommending otherwise), nothing beyond what a bounded executor
was sized for is ever sent, and every attach logs what it chose and why."""
import dataclasses
import logging

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.step_limits import StepLimitPolicy, StepLimits, StepLimitsGiven
from test_engine import DESCRIPTION, SPECS, FakeClient, run, serve

UNSET = StepLimitsGiven(max_num_batched_tokens=False, max_num_seqs=False)
H200 = StepLimits(8192, 1024, True, "vLLM's rule for NVIDIA H200, 139.8 GiB",
                  (1, 2, 4, 8, 16, 512, 1024), (16, 32, 512))
L40S = StepLimits(2048, 256, True, "vLLM's rule for NVIDIA L40S, 45.0 GiB")
CPU = StepLimits(2048, 128, False, "vLLM's rule for CPU, 62.0 GiB")


def chosen(config: SchedulerConfig) -> tuple[int, int]:
    return config.max_num_batched_tokens, config.max_num_seqs


def test_unset_flags_take_the_executors_recommendation_and_say_so(caplog):
    policy = StepLimitPolicy(SchedulerConfig(), UNSET)
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        assert chosen(policy.for_executor(H200, "gpu:1")) == (8192, 1024)
    assert caplog.messages == [
        "step limits with executor gpu:1: 8192 tokens (from the executor: vLLM's rule for NVIDIA "
        "H200, 139.8 GiB), 1024 seqs (from the executor: vLLM's rule for NVIDIA H200, 139.8 GiB) "
        "a step; decode graphs for 1-1024 seqs (7 sizes), small-step graphs for 16-512 tokens"]


def test_a_given_flag_wins_over_the_recommendation(caplog):
    policy = StepLimitPolicy(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
                             StepLimitsGiven(max_num_batched_tokens=True, max_num_seqs=False))
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        assert chosen(policy.for_executor(H200, "gpu:1")) == (4096, 1024)
    assert "4096 tokens (--max-num-batched-tokens; the executor recommends 8192)" in caplog.text
    given = StepLimitPolicy(SchedulerConfig(max_num_seqs=64), StepLimitsGiven())
    assert chosen(given.for_executor(H200, "gpu:1")) == (2048, 64)
    # the CPU backend's figures are advice: a larger flag stands
    more = StepLimitPolicy(SchedulerConfig(max_num_batched_tokens=9999, max_num_seqs=999),
                           StepLimitsGiven())
    assert chosen(more.for_executor(CPU, "cpu:1")) == (9999, 999)


def test_a_flag_beyond_what_a_bounded_executor_was_sized_for_is_capped(caplog):
    policy = StepLimitPolicy(SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=512),
                             StepLimitsGiven())
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        assert chosen(policy.for_executor(L40S, "gpu:2")) == (2048, 256)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "--max-num-batched-tokens 16384 is more than executor gpu:2 was sized for (2048): its "
        "steps stay within 2048; raise the executor's --max-num-batched-tokens to allow more",
        "--max-num-seqs 512 is more than executor gpu:2 was sized for (256): its steps stay "
        "within 256; raise the executor's --max-num-seqs to allow more"]
    assert "2048 tokens (--max-num-batched-tokens 16384, capped to what the executor was sized " \
        "for)" in caplog.text
    assert chosen(policy.for_executor(H200, "gpu:1")) == (8192, 512)  # the flag, as H200 allows


def test_a_replacement_recommending_otherwise_leaves_the_running_settings(caplog):
    policy = StepLimitPolicy(SchedulerConfig(), UNSET)
    assert chosen(policy.for_executor(H200, "gpu:1")) == (8192, 1024)
    bigger = dataclasses.replace(H200, max_num_batched_tokens=16384, max_num_seqs=2048)
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        assert chosen(policy.for_executor(bigger, "gpu:2")) == (8192, 1024)
    assert ("8192 tokens (kept from the first executor: vLLM's rule for NVIDIA H200, 139.8 GiB; "
            "this one recommends 16384)") in caplog.text
    # one sized for less is never sent more; the settings come back with the next executor
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        assert chosen(policy.for_executor(L40S, "gpu:3")) == (2048, 256)
    assert ("8192 tokens kept from the first executor is more than executor gpu:3 was sized for "
            "(2048)") in caplog.text
    assert chosen(policy.for_executor(H200, "gpu:1")) == (8192, 1024)


def test_an_executor_without_step_limits_gets_the_built_in_defaults(caplog):
    policy = StepLimitPolicy(SchedulerConfig(), UNSET)
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        assert chosen(policy.for_executor(None, "old:1")) == (2048, 256)
    assert "2048 tokens (built-in default: the executor recommends none)" in caplog.text
    assert "no CUDA graphs" in caplog.text
    assert chosen(policy.for_executor(CPU, "cpu:1")) == (2048, 128)  # the first recommendation


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs"])
def test_a_recommendation_no_config_can_hold_is_refused_by_name(field):
    policy = StepLimitPolicy(SchedulerConfig(), UNSET)
    with pytest.raises(ValueError, match=f"executor gpu:9 recommends {field} 0"):
        policy.for_executor(dataclasses.replace(H200, **{field: 0}), "gpu:9")


def test_decode_graphs_beyond_the_seq_cap_are_named_unused(caplog):
    policy = StepLimitPolicy(SchedulerConfig(max_num_seqs=8), StepLimitsGiven(False, True))
    with caplog.at_level(logging.INFO, "scheduler_svc.step_limits"):
        policy.for_executor(H200, "gpu:1")  # steps of 8 seqs replay graphs up to 8
    assert "decode graphs for 1-1024 seqs (7 sizes, 3 beyond the seq cap unused)" in caplog.text


class BoundedClient(FakeClient):
    """A fake executor sized for `limits`; records every plan's tokens and seqs."""

    def __init__(self, limits: StepLimits, **kwargs) -> None:
        super().__init__(**kwargs)
        self.limits, self.steps = limits, []

    async def connect(self):
        description = await super().connect()
        self.description = dataclasses.replace(description, step_limits=self.limits)
        return self.description

    async def send(self, plan) -> None:
        self.steps.append((plan.num_scheduled_tokens, plan.num_scheduled_seqs))
        await super().send(plan)


def test_the_engine_never_sends_more_than_a_bounded_executor_was_sized_for():
    client = BoundedClient(StepLimits(16, 3, True, "test"))
    config = EngineConfig(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    outputs, engine, _ = run(serve(client, SPECS, config))
    assert all(isinstance(out, list) and len(out) == 12 for out in outputs)
    assert max(tokens for tokens, _ in client.steps) == 16  # the cap, reached
    assert max(seqs for _, seqs in client.steps) == 3
    assert chosen(engine.scheduler.config) == (16, 3)


def test_the_engine_takes_the_executors_recommendation_when_no_flag_is_given():
    client = BoundedClient(StepLimits(32, 4, False, "test"))
    outputs, engine, _ = run(serve(client, SPECS, EngineConfig(step_limits_given=UNSET)))
    assert all(isinstance(out, list) and len(out) == 12 for out in outputs)
    assert chosen(engine.scheduler.config) == (32, 4)
    assert max(seqs for _, seqs in client.steps) == 4
    assert DESCRIPTION.step_limits is None  # the other engine tests' executor recommends none
