"""One quantized linear's checkpoint tensors to its Int4Weight or Fp8Weight, every tensor checked
against the shape the layer and the quantization_config imply (a mismatch names the tensor).
Layouts: AutoAWQ's WQLinear_GEMM, AutoGPTQ/GPTQModel's QuantLinear, compressed-tensors'
pack-quantized and float-quantized, AutoFP8's fp8. Imports torch only.
"""
from __future__ import annotations

from typing import Callable

import torch

from executor_svc.quantization.config import Fp8Scheme, Int4Scheme
from executor_svc.quantization.types import (PACK, SYMMETRIC_ZERO, Fp8Weight, Int4Weight,
                                             QuantizationError)

Getter = Callable[[str], "torch.Tensor | None"]  # a checkpoint tensor by name; None if absent
# AutoAWQ packs output columns 0..7 of a word into nibbles in this order (WQLinear_GEMM's
# order_map); column j of the word sits in nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SEQUENTIAL = tuple(range(PACK))
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def load_linear(get: Getter, name: str, scheme: Int4Scheme | Fp8Scheme, shape: tuple[int, int],
                dtype: torch.dtype) -> Int4Weight | Fp8Weight:
    """`name`: the module (model.layers.0.self_attn.q_proj); shape: its dense (N, K)."""
    check_linear(name, scheme, shape)
    if isinstance(scheme, Fp8Scheme):
        return _fp8(get, name, scheme, shape)
    n, k = shape
    group = k if scheme.group_size == -1 else scheme.group_size
    load = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _pack_quantized}[scheme.method]
    q, scales, zeros, g_idx = load(get, name, scheme, n, k, group)  # q: [K, N] 0..15
    perm = _act_order(name, g_idx, k, group) if g_idx is not None else None
    if perm is not None:
        q = q[perm]
    return Int4Weight(pack_rows(q), scales.to(dtype), zeros, group, perm)


def check_linear(name: str, scheme: Int4Scheme | Fp8Scheme, shape: tuple[int, int]) -> None:
    """What the layer's shape alone decides: the group size divides the input dimension, and
    4-bit packing fits both dimensions."""
    n, k = shape
    if isinstance(scheme, Fp8Scheme):
        if scheme.block_size is not None and k % scheme.block_size[1]:
            raise QuantizationError(f"{name}: the scale block's {scheme.block_size[1]} inputs do "
                                    f"not divide its input dimension {k}")
        return
    if scheme.group_size != -1 and k % scheme.group_size:
        raise QuantizationError(f"{name}: group_size {scheme.group_size} does not divide its "
                                f"input dimension {k}")
    if n % PACK or k % PACK:
        raise QuantizationError(f"{name}: dimensions {n} x {k} are not multiples of {PACK}, "
                                "which 4-bit packing needs")


def _awq(get, name, scheme, n, k, group):
    qweight = _tensor(get, f"{name}.qweight", (k, n // PACK), (torch.int32,))
    qzeros = _tensor(get, f"{name}.qzeros", (k // group, n // PACK), (torch.int32,))
    scales = _tensor(get, f"{name}.scales", (k // group, n), _SCALE_DTYPES)
    zeros = unpack_cols(qzeros, AWQ_REVERSE_ORDER).to(torch.uint8)
    return unpack_cols(qweight, AWQ_REVERSE_ORDER), scales, zeros, None


def _gptq(get, name, scheme, n, k, group):
    qweight = _tensor(get, f"{name}.qweight", (k // PACK, n), (torch.int32,))
    qzeros = _tensor(get, f"{name}.qzeros", (k // group, n // PACK), (torch.int32,))
    scales = _tensor(get, f"{name}.scales", (k // group, n), _SCALE_DTYPES)
    g_idx = None  # read whenever present (GPTQModel writes it always), needed for act-order
    if scheme.g_idx or get(f"{name}.g_idx") is not None:
        g_idx = _tensor(get, f"{name}.g_idx", (k,), (torch.int32, torch.int64))
    # The v1 format stores each zero point minus one (read back plus one, so 0 reads as 16:
    # what AutoGPTQ's kernels and vLLM's compute).
    zeros = unpack_cols(qzeros, _SEQUENTIAL) + (1 if scheme.gptq_v1 else 0)
    if scheme.sym:
        if not bool((zeros == SYMMETRIC_ZERO).all()):
            raise QuantizationError(f"{name}.qzeros holds zero points other than "
                                    f"{SYMMETRIC_ZERO}, but the quantization_config says sym: true")
        zeros = None
    else:
        zeros = zeros.to(torch.uint8)
    return unpack_rows(qweight), scales, zeros, g_idx


def _pack_quantized(get, name, scheme, n, k, group):
    packed = _tensor(get, f"{name}.weight_packed", (n, k // PACK), (torch.int32,))
    stored_shape = get(f"{name}.weight_shape")
    if stored_shape is not None and stored_shape.tolist() != [n, k]:
        raise QuantizationError(f"{name}.weight_shape says {stored_shape.tolist()}, the layer "
                                f"is {[n, k]}")
    scales = _tensor(get, f"{name}.weight_scale", (n, k // group), _SCALE_DTYPES).t()
    zeros = None
    if not scheme.sym:
        zp = _tensor(get, f"{name}.weight_zero_point", (n // PACK, k // group), (torch.int32,))
        zeros = unpack_rows(zp).t().contiguous().to(torch.uint8)  # stored + 8, as the weights
    g_idx = None
    if scheme.g_idx:
        g_idx = _tensor(get, f"{name}.weight_g_idx", (k,), (torch.int32, torch.int64))
    return unpack_cols(packed, _SEQUENTIAL).t(), scales.contiguous(), zeros, g_idx


def _act_order(name: str, g_idx: torch.Tensor, k: int, group: int) -> torch.Tensor | None:
    """The input order that makes each group `group` consecutive rows (None if it already is)."""
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(k) // group):
        raise QuantizationError(f"{name}.g_idx does not assign {group} input rows to each of "
                                f"{k // group} groups")
    return None if torch.equal(perm, torch.arange(k)) else perm


def _fp8(get, name: str, scheme: Fp8Scheme, shape: tuple[int, int]) -> Fp8Weight:
    n, k = shape
    weight = _tensor(get, f"{name}.weight", (n, k), (torch.float8_e4m3fn,))
    if scheme.block_size is not None:
        bn, bk = scheme.block_size
        suffix = "weight_scale_inv" if scheme.method == "fp8" else "weight_scale"
        scale = _tensor(get, f"{name}.{suffix}", (-(-n // bn), k // bk), _SCALE_DTYPES).float()
        return Fp8Weight(weight, scale, None, False, scheme.block_size)
    scale = _scale(get, f"{name}.weight_scale", n, scheme)
    input_scale = None
    if scheme.static:
        input_scale = get(f"{name}.input_scale")
        if input_scale is None or input_scale.numel() != 1:
            raise QuantizationError(f"{name}.input_scale: static activation quantization needs "
                                    "one scale per layer")
        input_scale = input_scale.reshape(()).float()
    return Fp8Weight(weight, scale, input_scale, scheme.per_token)


def _scale(get: Getter, name: str, n: int, scheme: Fp8Scheme) -> torch.Tensor:
    """[N] float32 from one scale or one per output row (compressed-tensors says which)."""
    scale = get(name)
    if scale is None:
        raise QuantizationError(f"{name} is missing (the quantization_config quantizes this "
                                "layer)")
    per_row = tuple(scale.shape) in ((n,), (n, 1))
    per_tensor = scale.numel() == 1 and scale.dim() <= 1
    ok = per_row or per_tensor
    if scheme.method == "compressed-tensors":
        ok = per_row if scheme.per_channel else per_tensor
    if not ok or scale.dtype not in _SCALE_DTYPES:
        raise QuantizationError(f"{name} is {scale.dtype} of shape {list(scale.shape)}; "
                                f"expected one float scale or one per output row ({n})")
    return scale.float().reshape(-1).expand(n).contiguous()


def _tensor(get: Getter, name: str, shape: tuple[int, ...], dtypes) -> torch.Tensor:
    t = get(name)
    if t is None:
        raise QuantizationError(f"{name} is missing (the quantization_config quantizes this "
                                "layer)")
    if tuple(t.shape) != shape:
        raise QuantizationError(f"{name} has shape {list(t.shape)}; the layer and its "
                                f"quantization_config make it {list(shape)}")
    if t.dtype not in dtypes:
        raise QuantizationError(f"{name} is {t.dtype}; expected {' or '.join(map(str, dtypes))}")
    return t


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, C] int32 words of 8 nibbles -> [R, 8C] int32 0..15; column 8c + j is nibble order[j]."""
    shifts = torch.tensor(order, dtype=torch.int32) * 4
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [8R, C] int32 0..15: row 8r + j is nibble j of row r."""
    shifts = torch.arange(PACK, dtype=torch.int32).view(1, PACK, 1) * 4
    return ((packed.unsqueeze(1) >> shifts) & 0xF).reshape(-1, packed.shape[1])


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[8R, C] 0..15 -> [R, C] int32, the inverse of unpack_rows."""
    v = values.to(torch.int32).reshape(-1, PACK, values.shape[1])
    shifts = torch.arange(PACK, dtype=torch.int32).view(1, PACK, 1) * 4
    return (v << shifts).sum(dim=1, dtype=torch.int32)
