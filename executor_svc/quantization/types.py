"""The quantized weights a linear can hold (Int4Weight, Fp8Weight), the one form each family of
methods loads into, and fusing the parts of a fused product (q|k|v, gate|up); the FP8 rows the op
before such a product hands it (Fp8Activation). Imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

PACK = 8  # 4-bit values per int32
SYMMETRIC_ZERO = 8  # the zero point of symmetric int4 (values 0..15 around 8)


class QuantizationError(ValueError):
    """A quantization_config or a quantized tensor we cannot serve; the message is one line."""


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit linear in the form every int4 method loads into (AWQ, GPTQ with or without
    act-order, compressed-tensors W4A16): GPTQ's layout with the input rows sorted by group, as
    Marlin and ExLlama repack act-order. W[n, perm[k]] = (q[k, n] - zeros[g, n]) * scales[g, n]
    with g = k // group_size."""

    qweight: torch.Tensor  # [K / 8, N] int32: nibble j (bits 4j..4j+3) of word r is row 8r + j
    scales: torch.Tensor  # [K / group_size, N], the model's dtype
    zeros: torch.Tensor | None  # [K / group_size, N] uint8, 0..16 (GPTQ v1 can say 16); None: 8
    group_size: int  # input rows per group (K for one group per output channel)
    perm: torch.Tensor | None  # [K] int64: row k of qweight multiplies x[:, perm[k]]; None: id

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), as a dense weight's."""
        return self.qweight.shape[1], self.qweight.shape[0] * PACK

    def to(self, device: torch.device | str) -> "Int4Weight":
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       zeros=_to(self.zeros, device), perm=_to(self.perm, device))


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 W8A8 linear: an e4m3 weight with a float32 scale per output row (a per-tensor scale
    repeated: one form for both) or per [bn, bk] block, activations quantized to e4m3 before the
    product (block-wise: a dynamic scale per token and bk inputs, as DeepSeek-V3's recipe)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor  # [N] float32; block-wise: [ceil(N / bn), K / bk]
    input_scale: torch.Tensor | None  # [] float32 (static); None: computed per step (dynamic)
    per_token: bool  # a dynamic scale per token (compressed-tensors), else one per tensor (fp8)
    block_size: tuple[int, int] | None = None  # (bn, bk) of block-wise scales

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    def to(self, device: torch.device | str) -> "Fp8Weight":
        return replace(self, weight=self.weight.to(device),
                       weight_scale=self.weight_scale.to(device),
                       input_scale=_to(self.input_scale, device))


@dataclass(frozen=True)
class Fp8Activation:
    """Rows quantized for an Fp8Weight with dynamic per-token scales by the op before the
    product, in that op's own pass (the backends' rms_norm or silu_and_mul with `feeds`): x ~
    values * scale."""

    values: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the rows' dtype before quantization: the product's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def takes_fp8_rows(weight) -> bool:
    """Whether `weight`'s input may come quantized from the op before it: FP8 W8A8 with a
    dynamic scale per token (a per-tensor or static scale needs the whole step's rows first)."""
    return (isinstance(weight, Fp8Weight) and weight.per_token and weight.input_scale is None
            and weight.block_size is None)


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def fuse(names: list[str], parts: list) -> torch.Tensor | Int4Weight | Fp8Weight:
    """One weight for the concatenated outputs of `parts` (dense tensors or one quantized kind)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, Int4Weight) for p in parts):
        return _fuse_int4(names, parts)
    if all(isinstance(p, Fp8Weight) for p in parts):
        return _fuse_fp8(names, parts)
    raise QuantizationError(f"{', '.join(names)}: parts of one fused product are quantized "
                            "differently (some not at all); a fused product takes one scheme")


def _fuse_int4(names: list[str], parts: list[Int4Weight]) -> Int4Weight:
    first = parts[0]
    for name, p in zip(names, parts):
        same_perm = (p.perm is None and first.perm is None) or (
            p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm))
        if p.group_size != first.group_size or not same_perm:
            raise QuantizationError(f"{name}: group size or g_idx differs from {names[0]}'s, "
                                    "but the two share one input and one fused product")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else
                           torch.full_like(p.scales, SYMMETRIC_ZERO, dtype=torch.uint8)
                           for p in parts], dim=1)
    return Int4Weight(torch.cat([p.qweight for p in parts], dim=1),
                      torch.cat([p.scales for p in parts], dim=1), zeros, first.group_size,
                      first.perm)


def _fuse_fp8(names: list[str], parts: list[Fp8Weight]) -> Fp8Weight:
    first = parts[0]
    if any(p.per_token != first.per_token or (p.input_scale is None) != (first.input_scale is None)
           or p.block_size != first.block_size for p in parts):
        raise QuantizationError(f"{', '.join(names)}: activation quantization or scale blocks "
                                "differ between parts of one fused product")
    if first.block_size is not None:  # a block of scales may not straddle two parts
        for name, p in zip(names[:-1], parts[:-1]):
            if p.shape[0] % first.block_size[0]:
                raise QuantizationError(f"{name}: {p.shape[0]} outputs are not a multiple of the "
                                        f"scale block's {first.block_size[0]}, but it is fused "
                                        "with the next part")
    input_scale = None
    if first.input_scale is not None:  # one static scale for the fused input: the largest (vLLM)
        input_scale = torch.stack([p.input_scale for p in parts]).max()
    return Fp8Weight(torch.cat([p.weight for p in parts]),
                     torch.cat([p.weight_scale for p in parts]), input_scale, first.per_token,
                     first.block_size)
