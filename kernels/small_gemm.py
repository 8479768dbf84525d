"""Launcher of the small-M matrix product (csrc/small_gemm.cu): y = x . w^T for M <= 128 rows
(decode batches), bf16/fp16, on Hopper's wgmma (sm_90a; other GPUs compile it empty and
`supported` says no). Each CTA streams 128 rows of w over a share of K (split-K over the grid's
y); the last split of a tile adds the fp32 partials in split order, so results are the same
bits whatever order the splits finish in, and the same for every launch of one (M, N, K,
splits). F.linear's contract otherwise: fp32 accumulation, one rounding.

Not used by the engine yet: measured against F.linear and cuBLASLt by
benchmarks/bench_small_gemm.py. Launches go to torch's current stream; a SmallGemmWorkspace
(fp32 partials, per-tile counters that each launch leaves at zero) serves one stream at a time.
"""
from __future__ import annotations

import torch

from kernels import _compile
from kernels._compile import i32 as _i32, i64 as _i64

MAX_ROWS = 128
SIZES = (16, 32, 64, 128)  # token tiles (the wgmma n); M is padded up to the next one
TILE_ROWS = 128  # rows of w per CTA
CHUNK = 64  # K elements per pipeline stage
_THREADS = 128
_STAGES = {16: 4, 32: 4, 64: 4, 128: 3}
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def token_tile(m: int) -> int:
    return next(size for size in SIZES if size >= m)


def smem_bytes(mt: int) -> int:
    return _STAGES[mt] * (TILE_ROWS * 128 + mt * 128) + 1024


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether small_linear can compute F.linear(x, weight): CUDA sm_90, bf16/fp16, x [M, K]
    with 1 <= M <= 128 and 16-byte aligned rows, weight [N, K] contiguous, N a multiple of 128
    and K of 64."""
    if not (x.is_cuda and weight.is_cuda and x.device == weight.device and x.dtype == weight.dtype
            and x.dtype in _DTYPES and x.dim() == 2 and weight.dim() == 2):
        return False
    (m, k), (n, kw) = x.shape, weight.shape
    es = x.element_size()
    return (torch.cuda.get_device_capability(x.device) == (9, 0) and 1 <= m <= MAX_ROWS
            and k == kw and n % TILE_ROWS == 0 and k % CHUNK == 0 and weight.is_contiguous()
            and x.stride(1) == 1 and (x.stride(0) * es) % 16 == 0 and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0)


def default_splits(n: int, k: int, num_sms: int) -> int:
    """Splits of K so that the CTAs (N / 128 tiles x splits) about fill the SMs once, each split
    at least 4 chunks of 64."""
    tiles, chunks = n // TILE_ROWS, k // CHUNK
    return max(1, min(round(num_sms / tiles), chunks // 4))


class SmallGemmWorkspace:
    """fp32 partials and per-tile counters for launches of up to `max_tiles` tiles x `max_splits`
    splits; allocate before a CUDA-graph capture that launches through it."""

    def __init__(self, device: torch.device, max_tiles: int, max_splits: int) -> None:
        self.max_tiles, self.max_splits = max_tiles, max_splits
        self.partials = torch.empty(max_tiles * max_splits * TILE_ROWS * MAX_ROWS,
                                    dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_tiles, dtype=torch.int32, device=device)


def small_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                 splits: int | None = None,
                 workspace: SmallGemmWorkspace | None = None) -> torch.Tensor:
    """F.linear(x, weight) for M <= 128 rows (see `supported`); out [M, N] contiguous, x's dtype,
    allocated when None. splits: of K over the grid (default_splits when None); more than one
    needs a workspace of at least N / 128 tiles x splits."""
    if not supported(x, weight):
        raise ValueError(f"small_linear cannot run x {tuple(x.shape)} {x.dtype} (strides "
                         f"{x.stride()}) by weight {tuple(weight.shape)} {weight.dtype} on "
                         f"{x.device}: see kernels.small_gemm.supported")
    (m, k), n = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if (out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device
            or not out.is_contiguous() or out.data_ptr() % 16):
        raise ValueError(f"out must be a contiguous, 16-byte aligned ({m}, {n}) {x.dtype} tensor "
                         f"on {x.device}")
    tiles, chunks = n // TILE_ROWS, k // CHUNK
    if splits is None:
        splits = default_splits(n, k, torch.cuda.get_device_properties(x.device).multi_processor_count)
    if not 1 <= splits <= chunks:
        raise ValueError(f"splits must be in [1, {chunks}] (K / {CHUNK}), got {splits}")
    if splits > 1 and (workspace is None or workspace.max_tiles < tiles
                       or workspace.max_splits < splits
                       or workspace.partials.device != x.device):
        raise ValueError(f"{splits} splits of {tiles} tiles need a SmallGemmWorkspace on "
                         f"{x.device} of at least that size")
    mt = token_tile(m)
    ws_ptr = workspace.partials.data_ptr() if splits > 1 else 0
    counters_ptr = workspace.counters.data_ptr() if splits > 1 else 0
    args = (x.data_ptr(), _i64(x.stride(0)), weight.data_ptr(), out.data_ptr(), _i64(n),
            _i32(m), _i32(k), ws_ptr, counters_ptr)
    _compile.launch("small_gemm", f"small_gemm_{_DTYPES[x.dtype]}_m{mt}", x.device,
                    (tiles, splits, 1), (_THREADS, 1, 1), args, shared_mem=smem_bytes(mt))
    return out
