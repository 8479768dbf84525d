"""Per-family weight names: a transformers state dict to the decoder's LayerWeights (fused q|k|v
and gate|up, Gemma's (1 + w) norms). Imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.model_config import ModelConfig

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
    """One [sum of outputs, hidden] matrix: the checkpoint's own fused one, or the parts'."""
    if is_fused:
        return weights[prefix + fused + ".weight"]
    return torch.cat([weights[prefix + name + ".weight"] for name in parts])
