"""Per-family weight names: a transformers state dict to the decoder's LayerWeights (fused q|k|v
and gate|up, Gemma's (1 + w) norms), and a quantized checkpoint's tensors to such a state dict
whose linears are quantized weights (executor_svc.quantization). Imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from executor_svc.model_config import ModelConfig
from executor_svc.quantization import (QuantConfig, QuantizationError, check_linear, fuse,
                                       load_linear)
from executor_svc.quantization.kv_cache import kv_cache_scales

# Families whose checkpoints hold q|k|v (Phi-3) or gate|up (Phi-3, GLM) already fused.
_FUSED_QKV = ("phi3",)
_FUSED_GATE_UP = ("phi3", "glm", "glm4")
# model_type -> (norm on the attention output, norm before the MLP, norm on the MLP output)
_NORM_NAMES = {
    "glm4": ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    "gemma2": ("post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"),
}
_NORM_NAMES["gemma3_text"] = _NORM_NAMES["gemma2"]
_PLAIN_NORMS = (None, "post_attention_layernorm", None)


@dataclass
class LayerWeights:
    """The projections are dense [N, K] tensors or, from a quantized checkpoint, Int4Weight /
    Fp8Weight (executor_svc.quantization); Backend.linear takes each."""

    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden], q|k|v fused
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2, GLM)
    o_proj: torch.Tensor  # [hidden, heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden], the norm before the MLP
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden], gate|up fused
    down_proj: torch.Tensor  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden] (attention_bias in Llama-style configs)
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden] (GLM-4, Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    window: int | None = None  # this layer's sliding window; None = full attention


def norm_weight(weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Gemma's RMSNorm scales by (1 + w), computed in float32 as transformers does."""
    return (1.0 + weight.float()).to(weight.dtype) if cfg.norm_plus_one else weight


def layer_weights(weights: dict[str, torch.Tensor], i: int, cfg: ModelConfig) -> LayerWeights:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    names = _NORM_NAMES.get(cfg.architecture, _PLAIN_NORMS) if cfg.sandwich_norms else _PLAIN_NORMS
    attn_out, pre_mlp, mlp_out = names

    def norm(name: str | None) -> torch.Tensor | None:
        return None if name is None else norm_weight(weights[p + name + ".weight"], cfg)

    qkv_bias = None
    if cfg.attention_bias and cfg.architecture not in _FUSED_QKV:
        qkv_bias = torch.cat([weights[attn + f"{n}_proj.bias"] for n in "qkv"])
    return LayerWeights(
        input_norm=norm("input_layernorm"),
        qkv_proj=_fused(weights, attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj",
                        cfg.architecture in _FUSED_QKV),
        qkv_bias=qkv_bias,
        o_proj=weights[attn + "o_proj.weight"],
        o_bias=weights.get(attn + "o_proj.bias"),
        post_attention_norm=norm(pre_mlp),
        gate_up_proj=_fused(weights, mlp, ("gate_proj", "up_proj"), "gate_up_proj",
                            cfg.architecture in _FUSED_GATE_UP),
        down_proj=weights[mlp + "down_proj.weight"],
        q_norm=norm_weight(weights[attn + "q_norm.weight"], cfg) if cfg.qk_norm else None,
        k_norm=norm_weight(weights[attn + "k_norm.weight"], cfg) if cfg.qk_norm else None,
        attn_out_norm=norm(attn_out),
        mlp_out_norm=norm(mlp_out),
        window=cfg.layer_window(i),
    )


def _fused(weights, prefix: str, parts: tuple[str, ...], fused: str, is_fused: bool):
    """One [sum of outputs, hidden] linear: the checkpoint's own fused one, or the parts'."""
    if is_fused:
        return weights[prefix + fused + ".weight"]
    names = [prefix + name for name in parts]
    return fuse(names, [weights[name + ".weight"] for name in names])


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every linear of the decoder layers, by module name, with its dense (N, K)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    if cfg.architecture in _FUSED_QKV:
        attn = {"qkv_proj": (q + 2 * kv, h)}
    else:
        attn = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h)}
    if cfg.architecture in _FUSED_GATE_UP:
        mlp = {"gate_up_proj": (2 * inter, h)}
    else:
        mlp = {"gate_proj": (inter, h), "up_proj": (inter, h)}
    per_layer = {**{f"self_attn.{n}": s for n, s in attn.items()}, "self_attn.o_proj": (h, q),
                 **{f"mlp.{n}": s for n, s in mlp.items()}, "mlp.down_proj": (h, inter)}
    return {f"model.layers.{i}.{n}": s for i in range(cfg.num_layers) for n, s in per_layer.items()}


def quantized_state_dict(get: Callable[[str], torch.Tensor | None], names: Iterable[str],
                         quant: QuantConfig, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A state dict (names as transformers') whose quantized linears are Int4Weight / Fp8Weight
    under "<module>.weight"; every other tensor in `dtype`. A quantized tensor left over (lm_head,
    embeddings, a KV-cache scale) is refused by name: only the layers' linears are served so."""
    used: set[str] = set()

    def tracked(name: str) -> torch.Tensor | None:
        used.add(name)
        return get(name)
    schemes = {m: (quant.scheme_for(m), shape) for m, shape in linear_shapes(cfg).items()}
    schemes = {m: s for m, s in schemes.items() if s[0] is not None}
    for module, (scheme, shape) in schemes.items():  # every layer's shape before any tensor
        check_linear(module, scheme, shape)
    weights: dict = {}
    for module, (scheme, shape) in schemes.items():
        weights[module + ".weight"] = load_linear(tracked, module, scheme, shape, dtype)
    if quant.kv_cache_scales:  # float32, as vLLM's: never rounded to the model's dtype
        weights.update(kv_cache_scales(tracked, cfg.num_layers))
    for name in names:
        if name in used:
            continue
        tensor = get(name)
        if not tensor.is_floating_point() or tensor.element_size() == 1:
            raise QuantizationError(f"{name} is {tensor.dtype}, but no linear the "
                                    f"quantization_config ({quant.name}) quantizes reads it: "
                                    "only the decoder layers' linears are served quantized")
        weights[name] = tensor.to(dtype)
    return weights
