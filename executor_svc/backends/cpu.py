"""CPU reference backend: the ops are the torch twins in pagedserve_kernels.reference, tensors on
CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_svc.quantization import Fp8Activation, Fp8Weight, Int4Weight, takes_fp8_rows
from pagedserve_kernels import reference


class CpuBackend:
    name = "cpu"
    device = torch.device("cpu")
    pin_swap_memory = False

    reshape_and_cache = staticmethod(reference.reshape_and_cache)
    paged_prefill_attention = staticmethod(reference.paged_prefill_attention)
    paged_decode_attention = staticmethod(reference.paged_decode_attention)
    swap_blocks = staticmethod(reference.swap_blocks)
    copy_blocks = staticmethod(reference.copy_blocks)
    head_rms_norm = staticmethod(reference.head_rms_norm)
    rotary_embedding = staticmethod(reference.rotary_embedding)
    rotary_embedding_and_cache = staticmethod(reference.rotary_embedding_and_cache)
    gelu_tanh_and_mul = staticmethod(reference.gelu_tanh_and_mul)
    apply_token_bitmask = staticmethod(reference.apply_token_bitmask)

    @staticmethod
    def rms_norm(x, weight, eps, out=None, feeds=None):
        """The twin; rows for a weight that takes FP8 ones quantized as the CUDA kernel does."""
        if takes_fp8_rows(feeds):
            return Fp8Activation(*reference.rms_norm_fp8(x, weight, eps), x.dtype)
        return reference.rms_norm(x, weight, eps, out)

    @staticmethod
    def fused_add_rms_norm(x, residual, weight, eps, feeds=None):
        if takes_fp8_rows(feeds):
            return Fp8Activation(*reference.rms_norm_fp8(x, weight, eps, residual),
                                 x.dtype), residual
        return reference.fused_add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(x, out=None, feeds=None):
        """The twin; `feeds` as rms_norm's."""
        if takes_fp8_rows(feeds):
            return Fp8Activation(*reference.quantize_fp8(reference.silu_and_mul(x)), x.dtype)
        return reference.silu_and_mul(x, out)

    @staticmethod
    def linear(x, weight, bias=None, out=None) -> torch.Tensor:
        """F.linear for a dense weight; a quantized one through its kernel's twin; copied into
        `out` when given."""
        y = CpuBackend._linear(x, weight, bias)
        return y if out is None else out.copy_(y)

    @staticmethod
    def _linear(x, weight, bias) -> torch.Tensor:
        if isinstance(x, Fp8Activation):  # the op before it quantized the rows for this weight
            return reference.fp8_scaled_linear(x.values, x.scale, weight.weight,
                                               weight.weight_scale, bias, x.dtype)
        if isinstance(weight, Int4Weight):
            return reference.int4_linear(x, weight.qweight, weight.scales, weight.zeros,
                                         weight.group_size, weight.perm, bias)
        if isinstance(weight, Fp8Weight):
            return reference.fp8_linear(x, weight.weight, weight.weight_scale,
                                        weight.input_scale, weight.per_token, bias,
                                        weight.block_size)
        return F.linear(x, weight, bias)

    @staticmethod
    def check_model(config) -> None:
        """The reference twins compute every feature of every supported family, and every
        quantization executor_svc.quantization loads."""

    @staticmethod
    def check_kv_cache_dtype(kv_cache_dtype: torch.dtype) -> None:
        """The twins read a cache of the model's dtype or FP8 (e4m3, per-layer scales)."""

    # What the worker asks of the device before it serves: the CPU has nothing to tune, profile,
    # capture or warm, so the worker's defaults stand and every step runs eagerly.

    @staticmethod
    def attention_impl(dtype: torch.dtype, head_dim: int) -> str:
        return "torch"

    @staticmethod
    def prepare_model(model, cache_dir: str | None, max_num_batched_tokens: int) -> None:
        pass

    @staticmethod
    def profile_num_blocks(model, block_size: int, block_bytes: int, utilization: float,
                           max_num_batched_tokens: int, max_num_seqs: int) -> None:
        return None

    @staticmethod
    def build_graphs(model, kv_caches, max_blocks_per_seq: int, dtype: torch.dtype,
                     decode_sizes: tuple[int, ...], token_sizes: tuple[int, ...],
                     grammars: bool = True, piece_sizes: tuple[int, ...] = ()) -> None:
        return None

    @staticmethod
    def graph_workspaces() -> list[torch.Tensor]:
        return []

    @staticmethod
    def warm_up(runner) -> None:
        pass
