"""The executor's step limits: vLLM's defaults for the device (`vllm serve`'s
--max-num-batched-tokens and --max-num-seqs, by device memory and name) unless flags set them, and
the CUDA-graph sizes they call for. Imports torch only to read the device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from executor_svc.step import StepLimits

_GIB = 1 << 30
# vLLM's EngineArgs.get_batch_defaults for its OpenAI server (max_num_batched_tokens,
# max_num_seqs): GPUs of 70 GiB or more take larger steps, except the A100, where vLLM measured
# larger steps costing throughput; its CPU platform takes 2048 and 128 (one worker).
_LARGE_GPU_BYTES = 70 * _GIB
LARGE_GPU = (8192, 1024)
OTHER_GPU = (2048, 256)
CPU = (2048, 128)
# vLLM's largest default capture size is min(2 * max_num_seqs, 512) tokens: above it a step's
# products outlast its eager launch.
_MAX_CAPTURE_TOKENS = 512
# Past vLLM's 512 for the piecewise graphs: an eager step launches each kernel from Python, so
# steps whose GPU time is shorter than that launch wait on it; profile_decode's piecewise variant
# shows where that ends.
PIECEWISE_MAX_TOKENS = 1024


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" | "cpu"
    name: str
    total_memory: int  # bytes

    def describe(self) -> str:
        return f"{self.name}, {self.total_memory / _GIB:.1f} GiB"


def device_of(device: torch.device) -> Device:
    """What vLLM's rule reads of `device`: CUDA's device properties, else the host's."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Device("cuda", props.name, props.total_memory)
    return Device("cpu", "CPU", _host_memory())


def _host_memory() -> int:
    try:
        return max(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), 0)
    except (AttributeError, ValueError, OSError):  # no sysconf, or not these names
        return 0


def vllm_batch_defaults(device: Device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` defaults to on `device`."""
    if device.kind == "cpu":
        return CPU
    if device.total_memory >= _LARGE_GPU_BYTES and "a100" not in device.name.lower():
        return LARGE_GPU
    return OTHER_GPU


def choose_step_limits(device: Device, max_model_len: int,
                       max_num_batched_tokens: int | None = None,
                       max_num_seqs: int | None = None) -> StepLimits:
    """The limits for `device` as vLLM sets its defaults: a value given (not None) stands; a
    defaulted token budget is at most max_num_seqs * max_model_len, a defaulted sequence cap at
    most the token budget. Bounded on a GPU (its memory profile and graphs are sized for them);
    no graph sizes yet (the worker adds those it captured)."""
    default_tokens, default_seqs = vllm_batch_defaults(device)
    seqs = max_num_seqs if max_num_seqs is not None else default_seqs
    tokens = max_num_batched_tokens
    if tokens is None:
        tokens = min(seqs * max_model_len, default_tokens)
    if max_num_seqs is None:
        seqs = min(seqs, tokens)
    return StepLimits(tokens, seqs, bounded=device.kind != "cpu",
                      source=_source(device, max_num_batched_tokens, max_num_seqs))


def _source(device: Device, max_num_batched_tokens: int | None, max_num_seqs: int | None) -> str:
    given = [flag for flag, value in (("--max-num-batched-tokens", max_num_batched_tokens),
                                      ("--max-num-seqs", max_num_seqs)) if value is not None]
    rule = f"vLLM's rule for {device.describe()}"
    if not given:
        return rule
    return ", ".join(given) if len(given) == 2 else f"{given[0]}, the other by {rule}"


def decode_graph_sizes(limits: StepLimits, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """Batch sizes of the decode graphs: `ladder`'s, up to the largest decode step the limits
    allow (a seq each, so at most the token budget). The ladder goes past vLLM's 512: eager decode
    steps of more sequences cost this executor more host time than vLLM's compiled ones."""
    return _up_to(ladder, min(limits.max_num_seqs, limits.max_num_batched_tokens, ladder[-1]))


def small_step_graph_sizes(limits: StepLimits, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """Token counts of the small-step graphs: `ladder`'s, up to vLLM's largest capture size
    (min(2 * max_num_seqs, 512), at most the token budget)."""
    cap = min(2 * limits.max_num_seqs, _MAX_CAPTURE_TOKENS, limits.max_num_batched_tokens)
    return _up_to(ladder, min(cap, ladder[-1]))


def piecewise_graph_sizes(limits: StepLimits, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """Token counts of the piecewise graphs: `ladder`'s from 16 (smaller steps have few enough
    seqs for the small-step graphs) up to PIECEWISE_MAX_TOKENS, at most the token budget."""
    cap = min(limits.max_num_batched_tokens, PIECEWISE_MAX_TOKENS, ladder[-1])
    return tuple(size for size in _up_to(ladder, cap) if size >= min(16, cap))


def _up_to(ladder: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """The ladder's sizes below `cap`, then `cap`: every step up to it has a graph and none is
    captured that no step can use (vLLM adds its token budget to its sizes the same way)."""
    return (*(size for size in ladder if size < cap), cap)


def describe(limits: StepLimits) -> str:
    """For the ready line: the values, where they came from, what they bind."""
    bound = "the scheduler's steps stay within them" if limits.bounded else "advice: no profile"
    return (f"{limits.max_num_batched_tokens} tokens and {limits.max_num_seqs} seqs a step "
            f"({limits.source}; {bound})")
