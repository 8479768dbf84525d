"""The backend seam: the model and cache engine call these ops (the signatures of
`pagedserve_kernels.reference`, plus `linear` with F.linear's contract), the worker what the
device needs before serving; nothing above calls a kernel or asks which backend it has.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from executor_svc.cuda_graphs import CudaGraphs
    from executor_svc.quantization import Fp8Activation
    from executor_svc.memory_profile import MemoryProfile


class Backend(Protocol):
    name: str  # "cpu" | "cuda"
    device: torch.device
    pin_swap_memory: bool  # allocate the CPU swap space pinned

    # The cache ops take a cache of the model's dtype or float8_e4m3fn (--kv-cache-dtype fp8):
    # then k_scale / v_scale ([] float32, the layer's) quantize what is written and dequantize
    # what attention reads; other caches ignore them.
    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None,
                          v_scale=None) -> None: ...

    def check_model(self, config) -> None:
        """Raises ValueError naming the first feature of `config` (a ModelConfig) this backend
        cannot compute, so that an unsupported model stops at load, never runs wrong."""
        ...

    def check_kv_cache_dtype(self, kv_cache_dtype: torch.dtype) -> None:
        """Raises ValueError (one line naming the feature) for a KV cache dtype this backend's
        attention cannot read; called before the model loads."""
        ...

    def paged_prefill_attention(
        self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None,
        sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
    ) -> torch.Tensor: ...

    def paged_decode_attention(
        self, q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, sliding_window=None,
        soft_cap=None, k_scale=None, v_scale=None,
    ) -> torch.Tensor: ...

    def swap_blocks(self, src_k, src_v, dst_k, dst_v, block_mapping) -> None: ...

    def copy_blocks(self, k_cache, v_cache, block_mapping) -> None: ...

    def rms_norm(self, x, weight, eps, out=None, feeds=None) -> torch.Tensor | Fp8Activation:
        """reference.rms_norm's; `feeds`: the weight the rows go to, which may take them
        quantized in the norm's pass (quantization.takes_fp8_rows): then an Fp8Activation."""
        ...

    def fused_add_rms_norm(self, x, residual, weight, eps, feeds=None
                           ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """reference.fused_add_rms_norm's; `feeds` as rms_norm's (then x is left as it is)."""
        ...

    def head_rms_norm(self, q, k, q_weight, k_weight, eps) -> None:
        """reference.head_rms_norm's: in place on q's and k's head rows."""
        ...

    def rotary_embedding(self, positions, q, k, cos_table, sin_table, interleaved=False) -> None:
        ...

    def rotary_embedding_and_cache(self, positions, q, k, value, cos_table, sin_table, k_cache,
                                   v_cache, slot_mapping, interleaved=False, k_scale=None,
                                   v_scale=None) -> None: ...

    def silu_and_mul(self, x, out=None, feeds=None) -> torch.Tensor | Fp8Activation:
        """reference.silu_and_mul's; `feeds` as rms_norm's (then `out` is not written)."""
        ...

    def gelu_tanh_and_mul(self, x, out=None) -> torch.Tensor: ...

    def linear(self, x, weight, bias=None, out=None) -> torch.Tensor:
        """x [T, K] -> [T, N]; weight: a dense [N, K] tensor (F.linear's contract) or a quantized
        linear (executor_svc.quantization: Int4Weight, Fp8Weight); x an Fp8Activation for an
        Fp8Weight that takes them. Into `out` [T, N] (contiguous) when given: the same values."""
        ...

    def apply_token_bitmask(self, logits, bitmask, indices=None) -> None:
        """In place: -inf on the tokens a grammar's bitmask disallows (reference's contract)."""
        ...

    # -- what the worker asks of the device before it serves ---------------------------------------

    def attention_impl(self, dtype: torch.dtype, head_dim: int) -> str:
        """Which attention computes this dtype and head size ("cupy" or "torch"), for the log."""
        ...

    def prepare_model(self, model, cache_dir: str | None, max_num_batched_tokens: int) -> None:
        """Device choices for `model`'s products (CUDA: int4 weights repacked for its kernel,
        GEMM algorithms kept in `cache_dir`), made before the memory profile and any graph
        capture."""
        ...

    def profile_num_blocks(self, model, block_size: int, block_bytes: int, utilization: float,
                           max_num_batched_tokens: int, max_num_seqs: int
                           ) -> MemoryProfile | None:
        """How many KV pages fit on the device beside `model` and the activations of a step of
        up to max_num_batched_tokens tokens sampling max_num_seqs rows; None: no profile, the
        worker's default stands."""
        ...

    def build_graphs(self, model, kv_caches, max_blocks_per_seq: int, dtype: torch.dtype,
                     decode_sizes: tuple[int, ...], token_sizes: tuple[int, ...],
                     grammars: bool = True, piece_sizes: tuple[int, ...] = ()
                     ) -> CudaGraphs | None:
        """The graph runner the model runner replays (decode graphs of `decode_sizes` seqs,
        small-step graphs of `token_sizes` tokens or of none, piecewise graphs of `piece_sizes`
        tokens for the steps between), None when every step runs eagerly; `grammars`: with the
        grammar-masked twins of the decode graphs (an executor without a tokenizer takes no
        grammar). It comes uncaptured: capture(counts) needs the runner's rows."""
        ...

    def graph_workspaces(self) -> list[torch.Tensor]:
        """Scratch tensors the kernels launched in a graph use; the graph keeps them alive."""
        ...

    def warm_up(self, runner) -> None:
        """Runs every path `runner` will take once, so nothing compiles or allocates on the first
        request; leaves the runner empty."""
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
