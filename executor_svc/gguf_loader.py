"""GGUF files in llama.cpp's layout: metadata to a ModelConfig, tensors (found by our own header
reader) dequantized by the gguf package and renamed to transformers' names, with llama.cpp's conversions undone (the Q/K
permutation of llama-arch RoPE). Imports torch, numpy and gguf; never transformers.
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from executor_svc.model_config import GGUF_ARCHITECTURES, ModelConfig, from_gguf
from pagedserve_common.gguf_metadata import read_gguf_header, read_gguf_metadata

# llama.cpp's per-layer tensor names -> transformers' (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Where a family's names differ (tensor_mapping.py of the gguf package, which the converter uses)
_FAMILY_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate|up fused, gate first
    "glm4": {"ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
             "post_ffw_norm": "post_mlp_layernorm"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_FAMILY_LAYER_NAMES["gemma3"] = _FAMILY_LAYER_NAMES["gemma2"]
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight",
                        "rope_factors_short.weight")
# the tokenizer models the scheduler builds (scheduler_svc/tokenizer.py)
_TOKENIZER_MODELS = ("gpt2", "llama")


class GgufError(ValueError):
    """A GGUF file this loader cannot serve; the message names the key or tensor."""


def read_architecture(path: str | Path) -> str:
    """The file's model_type, or GgufError for an architecture or tokenizer pagedserve cannot
    serve; reads the header only."""
    try:
        metadata = read_gguf_metadata(str(path), ("general.architecture", "tokenizer.ggml.model"))
    except (ValueError, struct.error, UnicodeDecodeError) as err:
        raise GgufError(f"not a readable GGUF file: {err}") from None
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GgufError(f"unsupported GGUF architecture {arch!r}; pagedserve loads "
                        f"{', '.join(GGUF_ARCHITECTURES)}")
    model = metadata.get("tokenizer.ggml.model")
    if model not in _TOKENIZER_MODELS:
        raise GgufError(f"the file's tokenizer model (tokenizer.ggml.model) is {model!r}; "
                        f"pagedserve builds {' and '.join(_TOKENIZER_MODELS)} vocabularies")
    return GGUF_ARCHITECTURES[arch]


def load_gguf(path: str | Path, dtype: torch.dtype, device: str | torch.device
              ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, weights by transformers' names in `dtype` on `device`) of a GGUF file."""
    read_architecture(path)
    metadata, tensors = _read(path)
    arch = metadata["general.architecture"]
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    factors = {name.removesuffix(".weight"): _dequantize(tensors.pop(name)).tolist()
               for name in _ROPE_FACTOR_TENSORS if name in tensors}
    try:
        config = from_gguf(metadata, shapes, factors)
    except (KeyError, ValueError) as err:
        raise GgufError(f"GGUF metadata: {err}") from None
    weights = {}
    for name, tensor in tensors.items():
        hf_name = _hf_name(name, arch, config.num_layers)
        weight = torch.from_numpy(_dequantize(tensor))
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, config.num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, config.num_kv_heads)
        weights[hf_name] = weight.to(dtype=dtype, device=device)
    return config, weights


class _Tensor(NamedTuple):
    data: np.ndarray  # the file's bytes, [rows, bytes of a row], a view of its memory map
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # llama.cpp's order: the row length first


def _read(path) -> tuple[dict, dict[str, _Tensor]]:
    """(metadata but the vocabulary, tensors by name): the header by our own reader, each
    tensor's bytes a view of the file's memory map."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        metadata, places = read_gguf_header(str(path))
    except (ValueError, struct.error, UnicodeDecodeError) as err:
        raise GgufError(f"not a readable GGUF file: {err}") from None
    # the vocabulary's arrays are the tokenizer's (the scheduler reads them); skip the copy
    metadata = {key: value for key, value in metadata.items()
                if not (key.startswith("tokenizer.") and isinstance(value, list))}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for place in places:
        try:
            kind = GGMLQuantizationType(place.ggml_type)
            block, block_bytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise GgufError(f"GGUF tensor {place.name!r} has ggml type {place.ggml_type}, "
                            "which the gguf package cannot dequantize") from None
        row = place.dims[0] if place.dims else 1
        rows = math.prod(place.dims[1:])
        if row % block:
            raise GgufError(f"GGUF tensor {place.name!r}: its rows of {row} are not whole "
                            f"{kind.name} blocks of {block}")
        row_bytes = row // block * block_bytes
        end = place.offset + rows * row_bytes
        if end > data.size:
            raise GgufError(f"GGUF tensor {place.name!r} runs past the end of the file "
                            f"({end} > {data.size} bytes): the file is cut short")
        tensors[place.name] = _Tensor(data[place.offset:end].reshape(rows, row_bytes), kind,
                                      place.dims)
    return metadata, tensors


def _dequantize(tensor: _Tensor) -> np.ndarray:
    """The tensor in float32, numpy order (llama.cpp's shape reversed); the gguf package's own
    dequantization, which llama.cpp's matches."""
    from gguf import quants

    values = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # a copy: the values of an F32 tensor are a read-only view of the file's memory map
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)


def _hf_name(name: str, arch: str, num_layers: int) -> str:
    """transformers' name of a llama.cpp tensor; GgufError for one the decoder does not use."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        base, suffix = name, ""
    parts = base.split(".")
    if len(parts) == 1 and base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < num_layers:
        names = {**_LAYER_NAMES, **_FAMILY_LAYER_NAMES.get(arch, {})}
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    raise GgufError(f"GGUF tensor {name!r} is not part of a {arch} decoder pagedserve serves")


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes the converter's LlamaModel.permute (rotate-half pairs to llama.cpp's adjacent
    pairs): rows [heads, 2, head_dim / 2] <- [heads, head_dim / 2, 2]."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
