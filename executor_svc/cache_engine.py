"""CacheEngine: owns the paged KV cache on the device and the CPU swap space, and moves pages
between them through the backend. Layout as pagedserve_kernels.reference:
[num_layers, num_blocks, num_kv_heads, block_size, head_dim], one tensor for K and one for V, of
the model's dtype or FP8 (e4m3: its pages move as bytes, never requantized).
"""
from __future__ import annotations

import torch

from executor_svc.attention_metadata import to_device
from pagedserve_kernels.reference import KV_FP8

_GIB = 1 << 30


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a resolved --kv-cache-dtype name: "fp8_e4m3", else the
    model's dtype."""
    return KV_FP8 if name == "fp8_e4m3" else model_dtype


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one page across all layers, K and V, of `dtype` (the cache's: an FP8 page is
    half a 16-bit one, so the same memory holds twice the pages)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * block_size * head_dim * element_size


def num_blocks_for(space_gib: float, block_bytes: int) -> int:
    return int(space_gib * _GIB) // block_bytes


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        backend,
    ) -> None:
        """dtype: the cache's element type (kv_cache_dtype)."""
        self.backend = backend
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_bytes = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        page = (num_kv_heads, block_size, head_dim)
        # Zeroed on a GPU (as vLLM's): a decode graph's pad seqs read one key of a stale block,
        # and a per-tensor activation scale (FP8) takes their rows in, so garbage there (inf)
        # would reach every row. The CPU backend has no graphs, and zeroing would commit the
        # whole cache's pages at start.
        alloc = torch.empty if torch.device(backend.device).type == "cpu" else torch.zeros
        self.gpu_k = alloc(num_layers, num_gpu_blocks, *page, dtype=dtype, device=backend.device)
        self.gpu_v = alloc(num_layers, num_gpu_blocks, *page, dtype=dtype, device=backend.device)
        pin = backend.pin_swap_memory
        self.cpu_k = torch.empty(num_layers, num_cpu_blocks, *page, dtype=dtype, pin_memory=pin)
        self.cpu_v = torch.empty_like(self.cpu_k, pin_memory=pin)

    @property
    def kv_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device caches (K, V): [num_layers, num_gpu_blocks, kv_heads, block_size, head_dim]."""
        return self.gpu_k, self.gpu_v

    def bytes_per_block(self) -> int:
        return self.block_bytes

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: device -> swap space."""
        if pairs:
            self.backend.swap_blocks(self.gpu_k, self.gpu_v, self.cpu_k, self.cpu_v,
                                     self._mapping(pairs))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: swap space -> device."""
        if pairs:
            self.backend.swap_blocks(self.cpu_k, self.cpu_v, self.gpu_k, self.gpu_v,
                                     self._mapping(pairs))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src gpu block, dst gpu block) pairs within the device cache (copy-on-write)."""
        if pairs:
            self.backend.copy_blocks(self.gpu_k, self.gpu_v, self._mapping(pairs))

    def _mapping(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """[n, 2] (src, dst) on the device, through pinned memory: the copy never makes the host
        wait for earlier steps still queued on the GPU."""
        return to_device(torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2), self.backend.device)
