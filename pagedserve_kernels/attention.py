"""Launchers of the paged attention kernels (csrc/attention.cu), as `pagedserve_kernels.reference`;
capturable: grids come from tensor shapes, scratch grows only outside capture. Imports cupy lazily.
"""
from __future__ import annotations

import math

import torch

from pagedserve_kernels import _compile
from pagedserve_kernels._compile import f32 as _f32, i32 as _i32, i64 as _i64

_THREADS = 128
_PREFILL_BM, _PREFILL_BN = 128, 64
_DECODE_BN = 64
_DECODE_STAGES = {64: 4, 128: 3}  # pipeline stages of the default decode kernels (attention.cu)
# Pages one decode split may span: bounds its smem page list (4 KiB beside hd128's 96 KiB of
# stages, 2 CTAs per SM either way), and lets a decode graph of max_model_len 8,192 (512-page
# tables) give each seq one split, with no combine, when seqs are many.
_DECODE_MAX_PAGES = 1024
MAX_GROUP = 16  # query heads per KV head served by one decode CTA (the MMA's M)
_HEAD_DIMS = (64, 128)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# (dtype, head_dim) -> kernel; benchmarks and tests swap in variants through these tables.
# Hopper (module built for sm_90a): the wgmma kernels; anything else: the mma.sync kernels.
PREFILL_KERNELS = {(dt, hd): f"prefill_wg_{name}_hd{hd}" for dt, name in _DTYPES.items() for hd in _HEAD_DIMS}
# (dtype, head_dim) -> (decode kernel, its pipeline stages); the benchmark swaps in candidates.
DECODE_KERNELS = {(dt, hd): (f"decode_{name}_hd{hd}", _DECODE_STAGES[hd])
                  for dt, name in _DTYPES.items() for hd in _HEAD_DIMS}
# Decode splits aim for about DECODE_CTAS_PER_SM CTAs per SM while the (seq, kv head) pairs are
# fewer than DECODE_MANY_PAIRS_PER_SM per SM, and for DECODE_CTAS_PER_SM_MANY from there on
# (see decode_splits): few seqs need many splits to fill the GPU, many seqs are better off
# without a combine (bench_kernels --only ragged; NOTES.md).
DECODE_CTAS_PER_SM = 12
DECODE_CTAS_PER_SM_MANY = 4
DECODE_MANY_PAIRS_PER_SM = 3
PREFILL_KERNELS_MMA_SYNC = {(dt, hd): f"prefill_{name}_hd{hd}" for dt, name in _DTYPES.items()
                            for hd in _HEAD_DIMS}
_WG_THREADS, _WG_BN = 256, 128


def prefill_launch_shape(kernel: str, head_dim: int, elem_bytes: int) -> tuple[int, int]:
    """(threads, dynamic shared memory bytes) of a prefill kernel by its name."""
    if kernel.startswith("prefill_wg"):  # 1 KiB for the manual 1024-byte alignment, Q, 2 x (K, V)
        return _WG_THREADS, 1024 + (_PREFILL_BM + 4 * _WG_BN) * head_dim * elem_bytes
    return _THREADS, (_PREFILL_BM + 2 * _PREFILL_BN) * head_dim * elem_bytes


def prefill_kernel(dtype: torch.dtype, head_dim: int, device: torch.device) -> str:
    kernel = PREFILL_KERNELS[(dtype, head_dim)]
    if kernel.startswith("prefill_wg"):
        _compile.get_module("attention", device)
        if _compile.arch_used(device) != "-arch=sm_90a":
            kernel = PREFILL_KERNELS_MMA_SYNC[(dtype, head_dim)]
    return kernel

_workspaces: dict[tuple[str, int], torch.Tensor] = {}
_num_sms: dict[int, int] = {}


def _workspace(name: str, device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached scratch tensor of at least `numel` elements (grown, never shrunk)."""
    key = (name, device.index)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        _workspaces[key] = buf
    return buf


def workspaces() -> list[torch.Tensor]:
    """The launchers' scratch tensors as they are now, every device. A CUDA graph captured with
    them must keep them referenced: a later eager launch may grow (replace) one, and the memory
    of the old one must not be freed while a graph still uses it."""
    return list(_workspaces.values())


def _sm_count(device: torch.device) -> int:
    if device.index not in _num_sms:
        _num_sms[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _num_sms[device.index]


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [num_blocks, num_kv_heads, block_size, "
                             f"head_dim] tensor, got shape {tuple(t.shape)} strides {t.stride()}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
                             f"got {t.dtype} on {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    block_size = k_cache.shape[2]
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim of the cache ({k_cache.shape[3]}) != q's ({q.shape[2]})")


def _check_q(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor, got {q.device}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] not in _HEAD_DIMS:
        raise ValueError(f"q must be [tokens, num_heads, head_dim] with head_dim in {_HEAD_DIMS}, "
                         f"got {tuple(q.shape)}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            raise ValueError(f"{name} needs a contiguous last dim, token/head strides that are "
                             f"multiples of 8 and a 16-byte aligned start; strides {t.stride()}")
    return out


def _check_index(name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    if t.dtype != torch.int32 or t.dim() != dims or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dims}-D int32 tensor on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads, num_kv_heads


def _check_group(num_heads: int, num_kv_heads: int) -> int:
    """The query heads per KV head, at most the decode kernels' MMA rows (MAX_GROUP)."""
    group = num_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"at most {MAX_GROUP} query heads per KV head, got {group}")
    return group


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new query tokens over everything cached for their sequence.

    q: [total_q_tokens, num_heads, head_dim] bf16/fp16, head_dim 64 or 128, sequences packed
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (one layer, new K/V written)
    block_tables: [num_seqs, max_blocks_per_seq] int32; cu_seqlens_q: [num_seqs + 1] int32;
    seq_lens: [num_seqs] int32 (context including the new tokens; query i of a sequence with q_len
    new tokens sits at position seq_len - q_len + i). returns out: [total_q_tokens, num_heads,
    head_dim]. Launches a tile-list kernel then the attention kernel on torch's current stream.
    """
    out, num_heads, num_kv_heads, num_seqs = _check_packed(q, out, k_cache, v_cache, block_tables,
                                                           cu_seqlens_q, seq_lens)
    total, device = q.shape[0], q.device
    if total == 0 or num_seqs == 0:
        return out
    head_dim, block_size = q.shape[2], k_cache.shape[2]
    num_entries = _num_tiles(total, num_seqs, _PREFILL_BM)
    tiles = _workspace("prefill_tiles", device, 2 * num_entries, torch.int32)
    _compile.launch("attention", "prefill_tiles", device, (1, 1, 1), (1024, 1, 1),
                    (cu_seqlens_q.data_ptr(), _i32(num_seqs), tiles.data_ptr(), _i32(num_entries)))
    kernel = prefill_kernel(q.dtype, head_dim, device)
    threads, smem = prefill_launch_shape(kernel, head_dim, q.element_size())
    args = (
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), tiles.data_ptr(),
        _i64(q.stride(0)), _i32(q.stride(1)), _i64(out.stride(0)), _i32(out.stride(1)),
        _i32(num_heads), _i32(num_kv_heads), _i32(block_size.bit_length() - 1),
        _i32(block_tables.shape[1]), _f32(scale * math.log2(math.e)),
    )
    _compile.launch("attention", kernel, device, (num_heads, num_entries, 1), (threads, 1, 1),
                    args, shared_mem=smem)
    return out


# Keys a few-query split keeps at least when a seq's tokens fill one CTA: its warps walk all four
# 16-key blocks of a stage (the one-token kernel's warps split them), so it takes shorter splits
# than decode's 256 keys; from two CTAs a head on, shorter splits lose and splits keep 256 keys
# (profile_decode.py --chunk; NOTES.md).
FEW_QUERY_SPLIT_KEYS = 128
# (dtype, head_dim) -> (multi-query decode kernel, its pipeline stages): as DECODE_KERNELS.
DECODE_MQ_KERNELS = {(dt, hd): (f"decode_mq_{name}_hd{hd}", _DECODE_STAGES[hd])
                     for dt, name in _DTYPES.items() for hd in _HEAD_DIMS}
# A candidate, off: entries of at most 16 query rows (a one-token seq of a mixed small step, a
# chunk's last few tokens) with their warps splitting the keys, as the one-token kernel does,
# where the default gives them one warp and leaves three idle. Off because it wins only with many
# decodes beside a chunk, which is rare (NOTES.md). The GPU test covers both kernels.
FEW_QUERY_KEY_SPLIT = False
DECODE_MQKS_KERNELS = {(dt, hd): (f"decode_mqks_{name}_hd{hd}", _DECODE_STAGES[hd])
                       for dt, name in _DTYPES.items() for hd in _HEAD_DIMS}


def paged_few_query_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_prefill_attention's semantics (same arguments, causal), for sequences with few query
    tokens over long contexts, e.g. a cached prefix's new tokens: the decode kernel's split of
    each context over CTAs, with up to 64 / group query tokens of one sequence in a CTA (their
    query heads are 16 MMA rows per warp, each warp over all of a stage's keys) sharing one read
    of the context. Launch shapes follow from the tensors' shapes only (capturable). The CUDA
    backend's prefill attention takes it for packed steps of few tokens (backends/cuda.py,
    FEW_QUERY_MAX).
    """
    out, num_heads, num_kv_heads, num_seqs = _check_packed(q, out, k_cache, v_cache, block_tables,
                                                           cu_seqlens_q, seq_lens)
    group = _check_group(num_heads, num_kv_heads)
    total, device = q.shape[0], q.device
    if total == 0 or num_seqs == 0:
        return out
    head_dim, block_size = q.shape[2], k_cache.shape[2]
    tpc = _THREADS // 32 * 16 // group  # query tokens per CTA: 16 rows per warp
    tiles, num_entries = _few_query_tiles(cu_seqlens_q, num_seqs, total, tpc)
    # Splits as for one seq's tokens (a cached prefix's new tokens, the common case): short ones
    # (FEW_QUERY_SPLIT_KEYS or 256 keys) over the whole width. Sized by the bound on entries
    # instead, a short step padded to many seqs would get a few long splits, one CTA walking
    # most of the context.
    usual = math.ceil(total / tpc)
    splits, chunk_pages = decode_splits(usual, num_kv_heads, block_tables.shape[1], block_size,
                                        _sm_count(device),
                                        min_keys=FEW_QUERY_SPLIT_KEYS if usual == 1 else 256)
    part_o, part_lse = _split_partials(device, total * num_heads, head_dim, splits)
    kernels = DECODE_MQKS_KERNELS if FEW_QUERY_KEY_SPLIT else DECODE_MQ_KERNELS
    kernel, stages = kernels[(q.dtype, head_dim)]
    args = (
        q.data_ptr(), out.data_ptr(), part_o, part_lse, k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), tiles.data_ptr(),
        _i32(tpc), _i64(q.stride(0)), _i32(q.stride(1)), _i64(out.stride(0)), _i32(out.stride(1)),
        _i32(num_heads), _i32(num_kv_heads), _i32(block_size.bit_length() - 1),
        _i32(block_tables.shape[1]), _i32(chunk_pages), _i32(splits),
        _f32(scale * math.log2(math.e)),
    )
    _compile.launch("attention", kernel, device, (splits, num_kv_heads, num_entries),
                    (_THREADS, 1, 1), args, shared_mem=_decode_smem(stages, head_dim, q))
    _combine_splits(out, part_o, part_lse, total, num_heads, splits)
    return out


def _few_query_tiles(cu_seqlens_q: torch.Tensor, num_seqs: int, total: int, tpc: int
                     ) -> tuple[torch.Tensor, int]:
    """(tile list, its entries): each entry up to `tpc` query tokens of one seq."""
    device = cu_seqlens_q.device
    # Every entry has a token: at most `total` of them, whatever the padding of seqs (a small-
    # step graph's 32 seqs would otherwise give 16 tokens 36 entries).
    num_entries = min(total, _num_tiles(total, num_seqs, tpc))
    tiles = _workspace("few_query_tiles", device, 2 * num_entries, torch.int32)
    _compile.launch("attention", "query_tiles", device, (1, 1, 1),
                    (min(1024, 32 * math.ceil(num_seqs / 32)), 1, 1),  # a thread per seq
                    (cu_seqlens_q.data_ptr(), _i32(num_seqs), tiles.data_ptr(),
                     _i32(num_entries), _i32(tpc)))
    return tiles, num_entries


def _decode_smem(stages: int, head_dim: int, q: torch.Tensor) -> int:
    """Dynamic shared memory of a decode-family kernel: its K/V stages and its page list."""
    return stages * 2 * _DECODE_BN * head_dim * q.element_size() + _DECODE_MAX_PAGES * 4


def _split_partials(device: torch.device, rows: int, head_dim: int, splits: int
                    ) -> tuple[int, int]:
    """(part_o, part_lse) pointers into the partials workspace for `rows` (token, head) rows
    split `splits` ways; (0, 0) when the context is not split (the kernel writes out itself)."""
    if splits <= 1:
        return 0, 0
    rows *= splits
    part = _workspace("decode_partials", device, rows * (head_dim + 1), torch.float32)
    return part.data_ptr(), part.data_ptr() + rows * head_dim * 4


def _combine_splits(out: torch.Tensor, part_o: int, part_lse: int, num_rows: int,
                    num_heads: int, splits: int) -> None:
    """Merges the splits' partials of `num_rows` rows into `out` (a second launch), if split."""
    if splits <= 1:
        return
    head_dim = out.shape[2]
    _compile.launch("attention", f"decode_combine_{_DTYPES[out.dtype]}", out.device,
                    (num_rows, num_heads, 1), (head_dim, 1, 1),
                    (part_o, part_lse, out.data_ptr(), _i64(out.stride(0)),
                     _i32(out.stride(1)), _i32(num_heads), _i32(splits), _i32(head_dim)))


def _check_packed(q, out, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens
                  ) -> tuple[torch.Tensor, int, int, int]:
    """Checks packed-query attention's arguments; returns (out, num_heads, num_kv_heads,
    num_seqs), `out` allocated when None."""
    out = _check_q(q, out)
    _check_cache(k_cache, v_cache, q)
    num_heads, num_kv_heads = _check_heads(q, k_cache)
    device, num_seqs = q.device, seq_lens.shape[0]
    _check_index("block_tables", block_tables, 2, device)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, device)
    _check_index("seq_lens", seq_lens, 1, device)
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_tables "
                         f"{tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} disagree")
    return out, num_heads, num_kv_heads, num_seqs


def _num_tiles(total: int, num_seqs: int, tile: int) -> int:
    """Entries of a tile list: sum_s ceil(q_len_s / tile) <= total / tile + num_seqs."""
    num_entries = math.ceil(total / tile) + num_seqs
    if num_entries > 65535:
        raise ValueError(f"too many query tiles for one launch ({num_entries} > 65535)")
    return num_entries


def decode_splits(num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                  num_sms: int, ctas_per_sm: int | None = None,
                  min_keys: int = 256) -> tuple[int, int]:
    """(num_splits, pages per split) from host-known shapes only (capturable).

    Splits bound each CTA's page list and, when sequences are few, spread one sequence over
    enough CTAs for about `ctas_per_sm` per SM (by default DECODE_CTAS_PER_SM, or
    DECODE_CTAS_PER_SM_MANY once the (seq, kv head) pairs alone reach DECODE_MANY_PAIRS_PER_SM
    per SM); each split keeps at least `min_keys` keys."""
    align = max(1, _DECODE_BN // block_size)  # split boundaries on stage boundaries
    max_pages = max(1, max_blocks_per_seq)
    splits = math.ceil(max_pages / _DECODE_MAX_PAGES)
    if not ctas_per_sm:
        many = num_seqs * num_kv_heads >= DECODE_MANY_PAIRS_PER_SM * num_sms
        ctas_per_sm = DECODE_CTAS_PER_SM_MANY if many else DECODE_CTAS_PER_SM
    want = math.ceil(ctas_per_sm * num_sms / max(1, num_seqs * num_kv_heads))
    splits = max(splits, min(want, math.ceil(max_pages * block_size / min_keys)))
    chunk = math.ceil(math.ceil(max_pages / splits) / align) * align
    chunk = min(chunk, _DECODE_MAX_PAGES)
    return math.ceil(max_pages / chunk), chunk


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (its last position) over the sequence's pages.

    q: [num_seqs, num_heads, head_dim] bf16/fp16 (head_dim 64/128, num_heads / num_kv_heads <= 16);
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]; block_tables:
    [num_seqs, max_blocks_per_seq] int32; seq_lens: [num_seqs] int32 including the new token
    (0 gives a zero row). returns out: [num_seqs, num_heads, head_dim]. When the context is split,
    partials go to a cached workspace and a combine kernel merges them (two launches).
    """
    out = _check_q(q, out)
    _check_cache(k_cache, v_cache, q)
    num_heads, num_kv_heads = _check_heads(q, k_cache)
    _check_group(num_heads, num_kv_heads)
    device = q.device
    num_seqs = q.shape[0]
    _check_index("block_tables", block_tables, 2, device)
    _check_index("seq_lens", seq_lens, 1, device)
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(f"q {tuple(q.shape)}, block_tables {tuple(block_tables.shape)} and "
                         f"seq_lens {tuple(seq_lens.shape)} disagree on num_seqs")
    if num_seqs == 0:
        return out
    head_dim, block_size = q.shape[2], k_cache.shape[2]
    splits, chunk_pages = decode_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size,
                                        _sm_count(device))
    part_o, part_lse = _split_partials(device, num_seqs * num_heads, head_dim, splits)
    kernel, stages = DECODE_KERNELS[(q.dtype, head_dim)]
    args = (
        q.data_ptr(), out.data_ptr(), part_o, part_lse, k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(),
        _i64(q.stride(0)), _i32(q.stride(1)), _i64(out.stride(0)), _i32(out.stride(1)),
        _i32(num_heads), _i32(num_kv_heads), _i32(block_size.bit_length() - 1),
        _i32(block_tables.shape[1]), _i32(chunk_pages), _i32(splits),
        _f32(scale * math.log2(math.e)),
    )
    _compile.launch("attention", kernel, device, (splits, num_kv_heads, num_seqs),
                    (_THREADS, 1, 1), args, shared_mem=_decode_smem(stages, head_dim, q))
    _combine_splits(out, part_o, part_lse, num_seqs, num_heads, splits)
    return out
