"""An FP8 KV cache's per-layer scales (k_scale, v_scale) from a quantized checkpoint's tensors, by
vLLM's names and rules, for the methods whose attention layers read them (fp8,
compressed-tensors). Imports torch only.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from executor_svc.quantization.types import QuantizationError

# Where checkpoints keep a layer's scale, relative to "model.layers.N.self_attn.", as vLLM's
# loader finds them: llm-compressor's kv_cache_scheme and fp8 folders ("k_scale"), ModelOpt
# ("k_proj.k_scale"), the output scales of k_proj / v_proj (get_cache_scale), and the deprecated
# one "kv_scale" for both.
_K_NAMES = ("k_scale", "k_proj.k_scale", "k_proj.output_scale")
_V_NAMES = ("v_scale", "v_proj.v_scale", "v_proj.output_scale")
_KV_NAME = "kv_scale"


def kv_cache_scales(get: Callable[[str], torch.Tensor | None], num_layers: int
                    ) -> dict[str, torch.Tensor]:
    """{"model.layers.N.self_attn.attn.k_scale" / "...v_scale" (vLLM's names for the scales it
    settles; no checkpoint's): [] float32} for every layer, as vLLM's BaseKVCacheMethod settles
    them: both in the checkpoint, each its own; neither, 1.0; one (or
    the deprecated kv_scale), that one for both. A scale that is not one positive finite number
    is refused by name."""
    scales = {}
    for i in range(num_layers):
        prefix = f"model.layers.{i}.self_attn."
        k = _first(get, prefix, _K_NAMES + (_KV_NAME,))
        v = _first(get, prefix, _V_NAMES)
        if k is None and v is None:
            k = v = 1.0
        elif k is None or v is None:
            k = v = max(s for s in (k, v) if s is not None)
        scales[prefix + "attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        scales[prefix + "attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    return scales


def _first(get, prefix: str, names: tuple[str, ...]) -> float | None:
    for name in names:
        tensor = get(prefix + name)
        if tensor is not None:
            return _scale(prefix + name, tensor)
    return None


def _scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise QuantizationError(f"{name} is {tensor.dtype} {list(tensor.shape)}, but an FP8 KV "
                                "cache takes one float scale per layer (per-tensor)")
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise QuantizationError(f"{name} is {value}: a KV cache scale must be positive and finite")
    return value
