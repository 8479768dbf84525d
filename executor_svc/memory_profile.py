"""GPU memory profile: how many KV pages fit in `gpu_memory_utilization` after the weights, a
profiled forward's activation peak and what the decode graphs hold. Imports torch only.
"""
from __future__ import annotations

import gc
import logging
import random
from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.graph_sampler import (MAX_CONTROLLED_BATCH, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS,
                                        region_slots)
from executor_svc.piecewise_graphs import PiecewiseGraphs
from executor_svc.sampler import Sampler, SamplingTensors
from executor_svc.step_limits import PIECEWISE_MAX_TOKENS
from executor_svc.step import SamplingOptions
from executor_svc.token_counts import TokenCounts

log = logging.getLogger(__name__)

_GIB = 1 << 30
# CUDA graphs allocate their pool after the KV cache: leave room for its forward activations
# (graph_reserve_bytes adds the sampling and the buffers on top).
_GRAPH_RESERVE_BYTES = 1 * _GIB


def graph_reserve_bytes(vocab_size: int, max_decode_batch: int, sampling_peak: int,
                        max_logit_bias: int = MAX_LOGIT_BIAS) -> int:
    """Bytes the decode graphs and their sampling take after the KV cache is made, for batches
    of up to max_decode_batch rows: the pool's forward activations (a fixed allowance) and its
    sampling peak (sampling_peak: measured eagerly on the variants the graphs capture,
    graph_sampling_peak), the float32 logits buffer, TokenCounts reserved for the batch (int32
    counts + prompt mask, ~0.6 GiB at 1,024 x 128k), and the sampler's outputs and parameter
    region."""
    logits = max_decode_batch * vocab_size * 4
    counts = TokenCounts.bytes_for(max_decode_batch, vocab_size)
    outputs = max_decode_batch * (8 + 4 + MAX_TOP_LOGPROBS * (8 + 4))
    params = region_slots(max_decode_batch, max_logit_bias) * 8
    return _GRAPH_RESERVE_BYTES + sampling_peak + logits + counts + outputs + params


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    used_after_weights: int  # device-wide, after the weights are loaded (context, other processes)
    activation_peak: int  # extra bytes the profiled forward + sampling allocated at peak
    sampling_peak: int  # of which the sampling of the full decode batch alone
    graph_reserve: int  # left for the decode graphs and their sampling (graph_reserve_bytes)
    graph_sampling_peak: int  # of which their sampling (graph_sampling_peak)
    kv_bytes: int
    num_gpu_blocks: int

    def line(self) -> str:
        return (f"total {self.total_bytes / _GIB:.1f} GiB, in use after weights "
                f"{self.used_after_weights / _GIB:.1f} GiB, activation peak "
                f"{self.activation_peak / _GIB:.2f} GiB (sampling "
                f"{self.sampling_peak / _GIB:.2f}), decode graphs {self.graph_reserve / _GIB:.2f} "
                f"GiB (sampling {self.graph_sampling_peak / _GIB:.2f}) -> KV cache "
                f"{self.kv_bytes / _GIB:.1f} GiB = {self.num_gpu_blocks} blocks")


@torch.inference_mode()
def profile_num_gpu_blocks(model, block_size: int, block_bytes: int, utilization: float,
                           max_num_batched_tokens: int, max_decode_batch: int,
                           device: torch.device) -> MemoryProfile:
    """Runs one prefill of max_num_batched_tokens tokens on a scratch cache, then samples
    max_decode_batch rows (top-p: the sort is the sampler's peak; a logit bias, penalties and
    logprobs), and sizes the KV cache."""
    cfg = model.config
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    # made before the baseline: reserved for good, it is counted in the graphs' reserve
    counts = TokenCounts(cfg.vocab_size, device)
    counts.reserve(max_decode_batch)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = _profile_forward(model, block_size, max_num_batched_tokens, max_decode_batch, device)
    forward_peak = torch.cuda.max_memory_allocated(device)
    sampling_peak = profile_sampling(logits, counts)
    activation_peak = max(forward_peak, torch.cuda.max_memory_allocated(device)) - before
    graph_sampling = graph_sampling_peak(logits, counts)
    del logits, counts
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    reserve = graph_reserve_bytes(cfg.vocab_size, max_decode_batch, graph_sampling)
    # the piecewise graphs' static buffers (their activations share the pool's allowance)
    reserve += PiecewiseGraphs.buffer_bytes(
        cfg, min(max_num_batched_tokens, PIECEWISE_MAX_TOKENS), model.embed_tokens.element_size())
    kv_bytes = int(total * utilization) - used - activation_peak - reserve
    num_blocks = max(kv_bytes, 0) // block_bytes
    if num_blocks < 1:
        raise RuntimeError(
            f"no room for a KV cache: {used / _GIB:.1f} GiB in use after loading weights, "
            f"{activation_peak / _GIB:.2f} GiB of activations, {total / _GIB:.1f} GiB on the device "
            f"at utilization {utilization}; raise --gpu-memory-utilization or lower "
            f"--max-num-batched-tokens")
    profile = MemoryProfile(total, used, activation_peak, sampling_peak, reserve, graph_sampling,
                            kv_bytes, num_blocks)
    log.info("memory profile: %s", profile.line())
    return profile


def _profile_forward(model, block_size: int, num_tokens: int, num_rows: int,
                     device: torch.device) -> torch.Tensor:
    """A prefill of num_tokens tokens; returns logits [num_rows, vocab] of its hidden states."""
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
    return model.compute_logits(hidden[rows])  # [num_rows, vocab]


def graph_sampling_peak(logits: torch.Tensor, counts: TokenCounts,
                        max_controlled_batch: int = MAX_CONTROLLED_BATCH) -> int:
    """The most the decode graphs' sampling allocates (logits: [max decode batch, vocab]): their
    controlled variant (every control) exists up to max_controlled_batch rows, the plain
    sampled and greedy ones at every batch size. Measured on the variants themselves, not on
    every control over the whole batch: that sort and those penalties are several GiB at 1,024
    rows of a 128k vocabulary, which would stay out of the KV cache for nothing (0 off CUDA)."""
    rows = min(max_controlled_batch, logits.shape[0])
    return max(profile_sampling(logits[:rows], counts),
               profile_sampling(logits, counts, controls=False))


@torch.inference_mode()
def profile_sampling(logits: torch.Tensor, counts: TokenCounts, controls: bool = True) -> int:
    """Samples logits [n, vocab] with every control on every row (top-p, top-k, min-p, a logit
    bias, all three penalties over rows 0..n-1 of `counts`, 20 top logprobs), as the eager
    Sampler and the graphs' controlled variant do (controls=False: a temperature alone, the
    graphs' sampled variant); returns the bytes it allocated at peak beyond what was allocated
    before (0 off CUDA)."""
    n, vocab = logits.shape
    cuda = logits.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(logits.device)
        base = torch.cuda.memory_allocated(logits.device)
        torch.cuda.reset_peak_memory_stats(logits.device)
    options = [SamplingOptions(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=i,
                               logit_bias=((0, 1.0),), logprobs=MAX_TOP_LOGPROBS,
                               repetition_penalty=1.1, presence_penalty=0.1,
                               frequency_penalty=0.1) if controls else
               SamplingOptions(temperature=1.0, seed=i)
               for i in range(n)]
    params = SamplingTensors.build(options, list(range(n)), vocab, logits.device, counts,
                                   list(range(n)))
    sampler = Sampler()
    token_ids, _ = sampler.sample(logits, params)
    if controls:
        counts.count(params.penalties.count_rows, token_ids)
        sampler.top_logprobs(logits, min(params.num_top_logprobs, vocab))
    if not cuda:
        return 0
    torch.cuda.synchronize(logits.device)
    return torch.cuda.max_memory_allocated(logits.device) - base
