"""RoPE cos/sin tables for every rope type the supported families use (default, linear, llama3,
LongRoPE), computed as transformers computes them. Imports torch only.
"""
from __future__ import annotations

import math

import torch

from executor_svc.model_config import LinearRope, LongRope, RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling=None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32 of a rope type (`scaling`: None, RopeScaling,
    LinearRope or LongRope; `long` picks LongRoPE's long factors)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if isinstance(scaling, LongRope):
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor,
                               dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if isinstance(scaling, LinearRope):
        return inv_freq / scaling.factor
    if isinstance(scaling, RopeScaling):
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(rotary_dim: int, theta: float, scaling, max_positions: int,
                long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, rotary_dim] float32, rows cat(f, f); LongRoPE's tables
    carry its attention factor, as transformers multiplies it into cos and sin."""
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling, long)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_pos, rotary_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rotary_dim]
    if isinstance(scaling, LongRope) and scaling.attention_factor != 1.0:
        return emb.cos() * scaling.attention_factor, emb.sin() * scaling.attention_factor
    return emb.cos(), emb.sin()
