"""GPU memory profile: how many KV pages fit in `gpu_memory_utilization` of the device once the
weights are loaded and a forward pass of `max_num_batched_tokens` (plus sampling of a full decode
batch) has shown its activation peak. Imports torch only.
"""
from __future__ import annotations

import gc
import logging
import random
from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.sampler import Sampler, SamplingTensors
from executor_svc.step import SamplingOptions

log = logging.getLogger(__name__)

_GIB = 1 << 30
# CUDA graphs allocate their pool after the KV cache: leave room for it (the float32 logits of
# the largest batch are added on top).
_GRAPH_RESERVE_BYTES = 1 * _GIB


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    used_after_weights: int  # device-wide, after the weights are loaded (context, other processes)
    activation_peak: int  # extra bytes the profiled forward + sampling allocated at peak
    kv_bytes: int
    num_gpu_blocks: int

    def line(self) -> str:
        return (f"total {self.total_bytes / _GIB:.1f} GiB, in use after weights "
                f"{self.used_after_weights / _GIB:.1f} GiB, activation peak "
                f"{self.activation_peak / _GIB:.2f} GiB -> KV cache {self.kv_bytes / _GIB:.1f} GiB "
                f"= {self.num_gpu_blocks} blocks")


@torch.inference_mode()
def profile_num_gpu_blocks(model, block_size: int, block_bytes: int, utilization: float,
                           max_num_batched_tokens: int, max_decode_batch: int,
                           device: torch.device) -> MemoryProfile:
    """Runs one prefill of max_num_batched_tokens tokens on a scratch cache, then samples
    max_decode_batch rows (top-p: the sort is the sampler's peak; a logit bias and logprobs), and
    sizes the KV cache."""
    cfg = model.config
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _profile_forward(model, block_size, max_num_batched_tokens, max_decode_batch, device)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    reserve = _GRAPH_RESERVE_BYTES + 2 * max_decode_batch * cfg.vocab_size * 4
    kv_bytes = int(total * utilization) - used - activation_peak - reserve
    num_blocks = max(kv_bytes, 0) // block_bytes
    if num_blocks < 1:
        raise RuntimeError(
            f"no room for a KV cache: {used / _GIB:.1f} GiB in use after loading weights, "
            f"{activation_peak / _GIB:.2f} GiB of activations, {total / _GIB:.1f} GiB on the device "
            f"at utilization {utilization}; raise --gpu-memory-utilization or lower "
            f"--max-num-batched-tokens")
    profile = MemoryProfile(total, used, activation_peak, kv_bytes, num_blocks)
    log.info("memory profile: %s", profile.line())
    return profile


def _profile_forward(model, block_size: int, num_tokens: int, num_rows: int,
                     device: torch.device) -> None:
    cfg = model.config
    num_blocks = -(-num_tokens // block_size)
    page = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    dtype = model.embed_tokens.dtype
    k_cache = torch.empty(cfg.num_layers, *page, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    rng = random.Random(0)
    input_ids = torch.tensor([rng.randrange(cfg.vocab_size) for _ in range(num_tokens)],
                             device=device)  # [num_tokens]
    positions, metadata = build_attention_metadata(
        [list(range(num_blocks))], [0], [num_tokens], block_size, device)
    hidden = model.forward(input_ids, positions, metadata, (k_cache, v_cache))
    rows = torch.arange(num_rows, device=device) % num_tokens
    logits = model.compute_logits(hidden[rows])  # [num_rows, vocab]
    # logit_bias copies the logits and logprobs adds a top-k; penalties are not profiled: their
    # counts grow with the seqs that use them (TokenCounts), like the KV they go with
    options = [SamplingOptions(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=i,
                               logit_bias=((0, 1.0),), logprobs=20)
               for i in range(num_rows)]
    params = SamplingTensors.build(options, list(range(num_rows)), cfg.vocab_size, device)
    Sampler().sample(logits, params)
    Sampler().top_logprobs(logits, params.num_top_logprobs)
