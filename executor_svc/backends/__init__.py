"""The backend seam: the model and cache engine call these ops (the signatures of
`pagedserve_kernels.reference`, plus `linear` with F.linear's contract), never kernels directly.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Backend(Protocol):
    name: str  # "cpu" | "cuda"
    device: torch.device
    pin_swap_memory: bool  # allocate the CPU swap space pinned

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None: ...

    def check_model(self, config) -> None:
        """Raises ValueError naming the first feature of `config` (a ModelConfig) this backend
        cannot compute, so that an unsupported model stops at load, never runs wrong."""
        ...

    def paged_prefill_attention(
        self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None,
        sliding_window=None, soft_cap=None,
    ) -> torch.Tensor: ...

    def paged_decode_attention(
        self, q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, sliding_window=None,
        soft_cap=None,
    ) -> torch.Tensor: ...

    def swap_blocks(self, src_k, src_v, dst_k, dst_v, block_mapping) -> None: ...

    def copy_blocks(self, k_cache, v_cache, block_mapping) -> None: ...

    def rms_norm(self, x, weight, eps, out=None) -> torch.Tensor: ...

    def fused_add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def rotary_embedding(self, positions, q, k, cos_table, sin_table, interleaved=False) -> None:
        ...

    def rotary_embedding_and_cache(self, positions, q, k, value, cos_table, sin_table, k_cache,
                                   v_cache, slot_mapping, interleaved=False) -> None: ...

    def silu_and_mul(self, x, out=None) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x, out=None) -> torch.Tensor: ...

    def linear(self, x, weight, bias=None) -> torch.Tensor:
        """x [T, K] -> [T, N]; weight: a dense [N, K] tensor (F.linear's contract) or a quantized
        linear (executor_svc.quantization: Int4Weight, Fp8Weight)."""
        ...


def get_backend(name: str) -> Backend:
    """The backend called `name`: "cpu" (torch reference ops) or "cuda" (the CuPy kernels,
    compiled before this returns)."""
    if name == "cpu":
        from executor_svc.backends.cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        from executor_svc.backends.cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown backend {name!r} (expected 'cpu' or 'cuda')")
