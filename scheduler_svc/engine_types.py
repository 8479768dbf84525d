"""The engine's public value types: its config, and what it reports (status, model info). Plain
dataclasses; no gRPC."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.request import RequestLimits
from scheduler_svc.scheduler_stats import SchedulerStats
from scheduler_svc.step_limits import StepLimitsGiven


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    # Sequences waiting to start (a request counts its n samples); beyond it, QueueFull.
    max_waiting: int = 4096
    unavailable_grace_s: float = 30.0
    # Steps sent before the oldest one's result is back: 2 lets the scheduler plan step N+1
    # while the executor runs step N (async scheduling); 1 is lockstep.
    max_steps_in_flight: int = 2
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Threads that tokenize and template prompts off the event loop (the tokenizer releases
    # the GIL); more would only let large prompts take more cores from the step loop.
    num_prepare_threads: int = 2
    # Seconds between stats lines (logged only for an interval in which a step ran); 0: none.
    log_stats_interval_s: float = 10.0
    # A stream is handed its tokens every stream_interval steps (its first token and its end at
    # once); 0: adaptive (output.stream_interval), so that many streams do not cost the step
    # loop a write each per step (vLLM's --stream-interval, made adaptive).
    stream_interval: int = 0
    # "auto": the model's generation_config.json gives requests their defaults (vLLM's
    # --generation-config); "vllm": the APIs' own defaults only.
    generation_config: str = "auto"
    # Which of `scheduler`'s step limits the operator set; the others come from the executor's
    # Describe (step_limits.StepLimitPolicy).
    step_limits_given: StepLimitsGiven = StepLimitsGiven()


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot for Admin.GetStatus; zeros while no executor is attached."""

    attached: bool
    executor_address: str
    model_name: str
    attach_error: str
    scheduler: SchedulerStats = SchedulerStats()
    steps: int = 0
    resyncs: int = 0
    loop_failures: int = 0
    draining: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What ModelInfo answers: the attached executor's model and pools."""

    model_name: str
    fingerprint: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    dtype: str
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    quantization: str = ""  # "": dense weights
    kv_cache_dtype: str = ""

    @classmethod
    def of(cls, d, eos_token_id: int | None) -> "ModelInfo":
        """From Describe's answer (scheduler_svc.wire.ExecutorDescription)."""
        return cls(d.model_name, d.fingerprint, d.max_model_len, d.vocab_size, eos_token_id,
                   d.dtype, d.block_size, d.num_gpu_blocks, d.num_cpu_blocks, d.quantization,
                   d.kv_cache_dtype)
