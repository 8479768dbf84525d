"""FP8 W8A8 products on Hopper: the activations quantized to e4m3 by the reference's rule, then
cuBLASLt's scaled product (torch._scaled_mm) with a scale per token and one per output channel
applied in its float32 epilogue, the bias there too. No host sync: capturable."""
from __future__ import annotations

import torch

from pagedserve_kernels import reference


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, per_token: bool = True,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference.fp8_linear's product (per-channel or per-tensor weight scales, dynamic or static
    activation scales) -> [T, N] in x's dtype. Row-wise scaled products write bf16 only: an fp16
    model's output is rounded through bf16."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return reference.fp8_linear(x, weight, weight_scale, input_scale, per_token, bias)
    xq, x_scale = reference.quantize_fp8(x.contiguous(), input_scale, per_token)
    return fp8_scaled_linear(xq, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_scaled_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """reference.fp8_scaled_linear's product (activations quantized already: xq [T, K] e4m3
    contiguous, x_scale [T, 1] or [1, 1] float32) -> [T, N] in out_dtype (bf16 or fp16)."""
    scale_a = x_scale.expand(xq.shape[0], 1).contiguous()  # [T, 1]: one per token
    scale_b = weight_scale.float().view(1, -1)  # [1, N]
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b,
                           bias=None if bias is None else bias.to(torch.bfloat16),
                           out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def supports(weight: torch.Tensor) -> bool:
    """cuBLASLt's FP8 products need both dimensions a multiple of 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0
