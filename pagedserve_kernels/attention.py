"""Launchers of the paged attention kernels (csrc/attention.cu), as `pagedserve_kernels.reference`;
capturable: grids come from tensor shapes, scratch grows only outside capture. Candidate kernels
are keyword arguments (`variant`, `key_split`, ...), production's the default. An FP8 (e4m3)
cache takes the same kernels built over it (csrc/kv_fp8.cu). Imports cupy lazily.
"""
from __future__ import annotations

import math

import torch

from pagedserve_kernels import _compile
from pagedserve_kernels._compile import f32 as _f32, i32 as _i32, i64 as _i64
from pagedserve_kernels.cache_ops import KV_FP8, kv_scale_args

_THREADS = 128
_PREFILL_BM, _PREFILL_BN = 128, 64
_DECODE_BN = 64
_DECODE_STAGES = {64: 4, 128: 3}  # pipeline stages of the default decode kernels (attention.cu)
_DECODE_STAGES_FP8 = {64: 4, 128: 2}  # the same over an FP8 cache (kv_fp8.cu)
# Pages one decode split may span: bounds its smem page list (4 KiB beside hd128's 96 KiB of
# stages, 2 CTAs per SM either way), and lets a decode graph of max_model_len 8,192 (512-page
# tables) give each seq one split, with no combine, when seqs are many.
_DECODE_MAX_PAGES = 1024
MAX_GROUP = 16  # query heads per KV head served by one decode CTA (the MMA's M)
_HEAD_DIMS = (64, 128)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# Decode splits aim for about DECODE_CTAS_PER_SM CTAs per SM while the (seq, kv head) pairs are
# fewer than DECODE_MANY_PAIRS_PER_SM per SM, and for DECODE_CTAS_PER_SM_MANY from there on
# (see decode_splits): few seqs need many splits to fill the GPU, many seqs are better off
# without a combine (bench_kernels --only ragged; NOTES.md).
DECODE_CTAS_PER_SM = 12
DECODE_CTAS_PER_SM_MANY = 4
DECODE_MANY_PAIRS_PER_SM = 3
_WG_THREADS, _WG_BN = 256, 128
_WGP_THREADS = 384  # the pipelined kernel's 2 consumer warpgroups and its producer warpgroup
# Prefill variants: "default" (on Hopper, whose module is built for sm_90a: at hd128 over a
# bf16/fp16 cache the pipelined kernel, FlashAttention-3's schedule with a producer warpgroup and
# the softmax under the MMAs; else the two-warpgroup wgmma kernel; elsewhere mma.sync), "wg" (the
# two-warpgroup wgmma kernel at every head dim, Hopper), "mma_sync" (the fallback, anywhere), and
# the candidates on Hopper by their kernels' prefix: "wg1" (a benchmark's wgmma bf16 hd64 at 1
# CTA per SM).
_PREFILL_CANDIDATES = {"wg1": "prefill_wg1"}
PREFILL_VARIANTS = ("default", "wg", "mma_sync", *_PREFILL_CANDIDATES)
# Decode variants: "default", and "s2" (the bf16 hd128 kernel with 2 stages, 3 CTAs per SM).
DECODE_VARIANTS = {"default": ("decode", _DECODE_STAGES), "s2": ("decode_s2", {128: 2})}
_VARIANTS = "attention_variants"  # the module of the candidates, built on demand (_compile)
_FP8 = "kv_fp8"  # the module of the kernels over an FP8 cache, built on first use (_compile.LAZY)


def prefill_launch_shape(kernel: str, head_dim: int, elem_bytes: int) -> tuple[int, int]:
    """(threads, dynamic shared memory bytes) of a prefill kernel by its name; elem_bytes: q's."""
    # An FP8 cache's kernel ("..._fp8") stages K/V bytes and converts them into one K/V tile of
    # q's dtype; the wgmma kernel's staging is double-buffered
    fp8 = kernel.endswith("_fp8")
    if kernel.startswith("prefill_wgp_"):  # the pipelined kernel: 2 Q buffers, 2 x (K, V)
        return _WGP_THREADS, 1024 + (2 * _PREFILL_BM + 4 * _WG_BN) * elem_bytes * head_dim
    if kernel.startswith("prefill_wg"):  # 1 KiB for the manual 1024-byte alignment, Q, 2 x (K, V)
        kv = (2 * elem_bytes + 4) if fp8 else 4 * elem_bytes
        return _WG_THREADS, 1024 + (_PREFILL_BM * elem_bytes + _WG_BN * kv) * head_dim
    kv = (2 * elem_bytes + 2) if fp8 else 2 * elem_bytes
    return _THREADS, (_PREFILL_BM * elem_bytes + _PREFILL_BN * kv) * head_dim


def prefill_grid(kernel: str, num_heads: int, num_entries: int, num_sms: int
                 ) -> tuple[tuple[int, int, int], tuple]:
    """(grid, trailing kernel arguments) of a prefill launch over a tile list of num_entries:
    a CTA per (head, entry), or for the pipelined kernel, persistent, at most one CTA an SM
    walking the num_heads x num_entries items, their count its last argument."""
    if kernel.startswith("prefill_wgp_"):
        items = num_heads * num_entries
        return (min(items, num_sms), 1, 1), (_i32(items),)
    return (num_heads, num_entries, 1), ()


def prefill_kernel(dtype: torch.dtype, head_dim: int, device: torch.device,
                   variant: str = "default", fp8: bool = False) -> str:
    """The prefill kernel's name for `variant` (PREFILL_VARIANTS); fp8: over an FP8 cache
    (default and mma_sync only)."""
    name = f"{_DTYPES[dtype]}_hd{head_dim}" + ("_fp8" if fp8 else "")
    if variant == "mma_sync":
        return f"prefill_{name}"
    if variant not in PREFILL_VARIANTS:
        raise ValueError(f"prefill variant must be one of {PREFILL_VARIANTS}, got {variant!r}")
    if fp8 and variant != "default":
        raise ValueError(f"the prefill variant {variant!r} has no kernel over an FP8 cache")
    kernel = None  # the default's, chosen by the module's arch below
    if variant == "wg":
        kernel = f"prefill_wg_{name}"
    elif variant != "default":  # a candidate's name is checked before anything compiles
        kernel = _candidate(f"{_PREFILL_CANDIDATES[variant]}_{name}")
    module = _FP8 if fp8 else "attention"
    _compile.get_module(module, device)
    hopper = _compile.arch_used(device, module) == "-arch=sm_90a"
    if kernel is None:
        if not hopper:
            return f"prefill_{name}"
        return f"prefill_wgp_{name}" if head_dim == 128 and not fp8 else f"prefill_wg_{name}"
    if not hopper:
        raise ValueError(f"{kernel} needs the module built for sm_90a (a Hopper GPU)")
    return kernel


def decode_kernel(dtype: torch.dtype, head_dim: int, variant: str = "default",
                  fp8: bool = False) -> tuple[str, int]:
    """(the decode kernel's name, its pipeline stages) for `variant` (DECODE_VARIANTS); fp8: over
    an FP8 cache (the default only)."""
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"decode variant must be one of {tuple(DECODE_VARIANTS)}, got {variant!r}")
    prefix, stages = DECODE_VARIANTS[variant]
    kernel = f"{prefix}_{_DTYPES[dtype]}_hd{head_dim}"
    if fp8:
        if variant != "default":
            raise ValueError(f"the decode variant {variant!r} has no kernel over an FP8 cache")
        return f"{kernel}_fp8", _DECODE_STAGES_FP8[head_dim]
    if variant != "default":
        _candidate(kernel)
    return kernel, stages[head_dim]


def _candidate(kernel: str) -> str:
    """A candidate kernel's name, checked: one the variants module builds."""
    if kernel not in _compile.ON_DEMAND[_VARIANTS][2]:
        raise ValueError(f"no candidate kernel {kernel} in {_VARIANTS}")
    return kernel


def _module_of(kernel: str) -> str:
    if kernel in _compile.MODULES["attention"][1]:
        return "attention"
    return _FP8 if kernel in _compile.MODULES[_FP8][1] else _VARIANTS


def _features(sliding_window: int | None, soft_cap: float | None) -> tuple:
    """The kernels' (window, soft_cap) arguments, 0 for none; ValueError naming a bad value."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if soft_cap is not None and not (0 < soft_cap < math.inf):
        raise ValueError(f"soft_cap must be None or a positive finite number, got {soft_cap!r}")
    window = min(int(sliding_window or 0), 2**31 - 1)
    return _i32(window), _f32(soft_cap or 0.0)


def window_pages(sliding_window: int | None, tokens: int, block_size: int, max_pages: int) -> int:
    """Pages the keys of `tokens` consecutive queries can span: with a window W, the W + tokens - 1
    keys from the first query's window on, from any offset in a page; at most `max_pages`."""
    if not sliding_window:
        return max_pages
    keys = sliding_window + tokens - 1
    return min(max_pages, (keys + block_size - 2) // block_size + 1)


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
        if t.dtype not in (q.dtype, KV_FP8) or t.dtype != k_cache.dtype or t.device != q.device:
            raise ValueError(f"{name} must be of q's dtype or float8_e4m3fn (an FP8 cache), both "
                             f"caches alike, on q's device ({q.dtype}, {q.device}), got "
                             f"{t.dtype} on {t.device}")
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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    variant: str = "default",
) -> torch.Tensor:
    """Causal attention of new query tokens over everything cached for their sequence.

    q: [total_q_tokens, num_heads, head_dim] bf16/fp16, head_dim 64 or 128, sequences packed
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (one layer, new K/V
    written), of q's dtype or FP8 (float8_e4m3fn: an element x of k_cache reads as x * k_scale,
    of v_cache as x * v_scale, the layer's scales, [] float32 on the device; other caches ignore
    them)
    block_tables: [num_seqs, max_blocks_per_seq] int32; cu_seqlens_q: [num_seqs + 1] int32;
    seq_lens: [num_seqs] int32 (context including the new tokens; query i of a sequence with q_len
    new tokens sits at position seq_len - q_len + i). sliding_window W: a query sees its W most
    recent positions (tiles before them are not read); soft_cap c: scores c * tanh(score / c)
    (reference._attend's). variant: PREFILL_VARIANTS. returns out: [total_q_tokens, num_heads,
    head_dim]. Launches a tile-list kernel then the attention kernel on torch's current stream.
    """
    out, num_heads, num_kv_heads, num_seqs = _check_packed(q, out, k_cache, v_cache, block_tables,
                                                           cu_seqlens_q, seq_lens)
    features = _features(sliding_window, soft_cap)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    total, device = q.shape[0], q.device
    if total == 0 or num_seqs == 0:
        return out
    head_dim, block_size = q.shape[2], k_cache.shape[2]
    kernel = prefill_kernel(q.dtype, head_dim, device, variant, fp8=bool(scales))
    threads, smem = prefill_launch_shape(kernel, head_dim, q.element_size())
    num_entries = _num_tiles(total, num_seqs, _PREFILL_BM)
    tiles = _workspace("prefill_tiles", device, 2 * num_entries, torch.int32)
    _compile.launch("attention", "prefill_tiles", device, (1, 1, 1), (1024, 1, 1),
                    (cu_seqlens_q.data_ptr(), _i32(num_seqs), tiles.data_ptr(), _i32(num_entries)))
    grid, extra = prefill_grid(kernel, num_heads, num_entries, _sm_count(device))
    args = (
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), tiles.data_ptr(),
        _i64(q.stride(0)), _i32(q.stride(1)), _i64(out.stride(0)), _i32(out.stride(1)),
        _i32(num_heads), _i32(num_kv_heads), _i32(block_size.bit_length() - 1),
        _i32(block_tables.shape[1]), _f32(scale * math.log2(math.e)), *features, *scales, *extra,
    )
    _compile.launch(_module_of(kernel), kernel, device, grid, (threads, 1, 1), args,
                    shared_mem=smem)
    return out


# Keys a few-query split keeps at least when a seq's tokens fill one CTA: its warps walk all four
# 16-key blocks of a stage (the one-token kernel's warps split them), so it takes shorter splits
# than decode's 256 keys; from two CTAs a head on, shorter splits lose and splits keep 256 keys
# (profile_decode.py --chunk; NOTES.md).
FEW_QUERY_SPLIT_KEYS = 128


def paged_few_query_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    key_split: bool = False,
    split_keys: int = FEW_QUERY_SPLIT_KEYS,
) -> torch.Tensor:
    """paged_prefill_attention's semantics (same arguments, causal), for sequences with few query
    tokens over long contexts, e.g. a cached prefix's new tokens: the decode kernel's split of
    each context over CTAs, with up to 64 / group query tokens of one sequence in a CTA (their
    query heads are 16 MMA rows per warp, each warp over all of a stage's keys) sharing one read
    of the context; with a window the splits cover only the window's pages. Launch shapes follow
    from the tensors' shapes only (capturable). Candidates (benchmarks, tests): key_split
    (_few_query_kernel); split_keys, the fewest keys of a split when a seq's tokens fill one CTA.
    """
    out, num_heads, num_kv_heads, num_seqs = _check_packed(q, out, k_cache, v_cache, block_tables,
                                                           cu_seqlens_q, seq_lens)
    group = _check_group(num_heads, num_kv_heads)
    features = _features(sliding_window, soft_cap)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    total, device = q.shape[0], q.device
    if total == 0 or num_seqs == 0:
        return out
    head_dim, block_size = q.shape[2], k_cache.shape[2]
    tpc = _THREADS // 32 * 16 // group  # query tokens per CTA: 16 rows per warp
    tiles, num_entries = _few_query_tiles(cu_seqlens_q, num_seqs, total, tpc)
    # Splits as for one seq's tokens (a cached prefix's new tokens, the common case): short ones
    # (split_keys or 256 keys) over the width (or window). Sized by the bound on entries instead,
    # a short step padded to many seqs would get a few long splits, one CTA walking most of it.
    usual = math.ceil(total / tpc)
    span = window_pages(sliding_window, tpc, block_size, block_tables.shape[1])
    splits, chunk_pages = decode_splits(usual, num_kv_heads, span, block_size, _sm_count(device),
                                        min_keys=split_keys if usual == 1 else 256)
    part_o, part_lse = _split_partials(device, total * num_heads, head_dim, splits)
    kernel = _few_query_kernel(q.dtype, head_dim, key_split, fp8=bool(scales))
    args = (
        q.data_ptr(), out.data_ptr(), part_o, part_lse, k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), tiles.data_ptr(),
        _i32(tpc), _i64(q.stride(0)), _i32(q.stride(1)), _i64(out.stride(0)), _i32(out.stride(1)),
        _i32(num_heads), _i32(num_kv_heads), _i32(block_size.bit_length() - 1),
        _i32(block_tables.shape[1]), _i32(chunk_pages), _i32(splits),
        _f32(scale * math.log2(math.e)), *features, *scales,
    )
    _compile.launch(_module_of(kernel), kernel, device, (splits, num_kv_heads, num_entries),
                    (_THREADS, 1, 1), args,
                    shared_mem=_decode_smem(_DECODE_STAGES[head_dim], head_dim, q,
                                            fp8=bool(scales), few_query=True))
    _combine_splits(out, part_o, part_lse, total, num_heads, splits)
    return out


def _few_query_kernel(dtype: torch.dtype, head_dim: int, key_split: bool,
                      fp8: bool = False) -> str:
    """The few-query kernel, or with key_split the candidate whose entries of at most 16 query
    rows (a one-token seq of a mixed step, a chunk's last few tokens) have their warps split the
    keys, as the one-token kernel does, where the default gives them one warp and leaves three
    idle; it wins only with many decodes beside a chunk, which is rare (NOTES.md). fp8: over an
    FP8 cache (not key_split)."""
    if fp8:
        if key_split:
            raise ValueError("key_split has no few-query kernel over an FP8 cache")
        return f"decode_mq_{_DTYPES[dtype]}_hd{head_dim}_fp8"
    kernel = f"decode_{'mqks' if key_split else 'mq'}_{_DTYPES[dtype]}_hd{head_dim}"
    return _candidate(kernel) if key_split else kernel


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


def _decode_smem(stages: int, head_dim: int, q: torch.Tensor,
                 max_pages: int = _DECODE_MAX_PAGES, fp8: bool = False,
                 few_query: bool = False) -> int:
    """Dynamic shared memory of a decode-family kernel: its K/V stages and its page list; over an
    FP8 cache, stages of bytes and the tile of q's dtype they are converted into: K and V for the
    few-query kernel, K then V in the same tile for the one-token kernel (attention.cu)."""
    tile = 2 * _DECODE_BN * head_dim * q.element_size()
    if fp8:
        return (stages * 2 * _DECODE_BN * head_dim + (tile if few_query else tile // 2)
                + max_pages * 4)
    return stages * tile + max_pages * 4


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


def decode_splits(num_seqs: int, num_kv_heads: int, span_pages: int, block_size: int,
                  num_sms: int, ctas_per_sm: int | None = None, min_keys: int = 256,
                  max_pages: int = _DECODE_MAX_PAGES) -> tuple[int, int]:
    """(num_splits, pages per split) from host-known shapes only (capturable).

    Splits cover `span_pages` pages (a table's width, or window_pages' span), bound each CTA's
    page list to `max_pages` and, when sequences are few, spread one sequence over enough CTAs
    for about `ctas_per_sm` per SM (by default DECODE_CTAS_PER_SM, or DECODE_CTAS_PER_SM_MANY
    once the (seq, kv head) pairs alone reach DECODE_MANY_PAIRS_PER_SM per SM); each split keeps
    at least `min_keys` keys."""
    align = max(1, _DECODE_BN // block_size)  # split boundaries on stage boundaries
    pages = max(1, span_pages)
    splits = math.ceil(pages / max_pages)
    if not ctas_per_sm:
        many = num_seqs * num_kv_heads >= DECODE_MANY_PAIRS_PER_SM * num_sms
        ctas_per_sm = DECODE_CTAS_PER_SM_MANY if many else DECODE_CTAS_PER_SM
    want = math.ceil(ctas_per_sm * num_sms / max(1, num_seqs * num_kv_heads))
    splits = max(splits, min(want, math.ceil(pages * block_size / min_keys)))
    chunk = math.ceil(math.ceil(pages / splits) / align) * align
    chunk = min(chunk, max_pages)
    return math.ceil(pages / chunk), chunk


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    variant: str = "default",
    ctas_per_sm: int | None = None,
    max_pages: int = _DECODE_MAX_PAGES,
) -> torch.Tensor:
    """One query token per sequence (its last position) over the sequence's pages.

    q: [num_seqs, num_heads, head_dim] bf16/fp16 (head_dim 64/128, num_heads / num_kv_heads <= 16);
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]; block_tables:
    [num_seqs, max_blocks_per_seq] int32; seq_lens: [num_seqs] int32 including the new token
    (0 gives a zero row); sliding_window, soft_cap, an FP8 cache's k_scale / v_scale: as
    paged_prefill_attention (with a window the splits cover only its pages). returns out:
    [num_seqs, num_heads, head_dim]. When the context is split, partials go to a cached workspace
    and a combine kernel merges them (two launches).
    Candidates (benchmarks, tests): variant (DECODE_VARIANTS); the split policy's ctas_per_sm and
    max_pages (decode_splits).
    """
    out, num_heads, num_kv_heads = _check_decode(q, out, k_cache, v_cache, block_tables, seq_lens)
    features = _features(sliding_window, soft_cap)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    num_seqs, device = q.shape[0], q.device
    if num_seqs == 0:
        return out
    head_dim, block_size = q.shape[2], k_cache.shape[2]
    span = window_pages(sliding_window, 1, block_size, block_tables.shape[1])
    splits, chunk_pages = decode_splits(num_seqs, num_kv_heads, span, block_size,
                                        _sm_count(device), ctas_per_sm, max_pages=max_pages)
    part_o, part_lse = _split_partials(device, num_seqs * num_heads, head_dim, splits)
    kernel, stages = decode_kernel(q.dtype, head_dim, variant, fp8=bool(scales))
    args = (
        q.data_ptr(), out.data_ptr(), part_o, part_lse, k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(),
        _i64(q.stride(0)), _i32(q.stride(1)), _i64(out.stride(0)), _i32(out.stride(1)),
        _i32(num_heads), _i32(num_kv_heads), _i32(block_size.bit_length() - 1),
        _i32(block_tables.shape[1]), _i32(chunk_pages), _i32(splits),
        _f32(scale * math.log2(math.e)), *features, *scales,
    )
    _compile.launch(_module_of(kernel), kernel, device, (splits, num_kv_heads, num_seqs),
                    (_THREADS, 1, 1), args,
                    shared_mem=_decode_smem(stages, head_dim, q, max_pages, fp8=bool(scales)))
    _combine_splits(out, part_o, part_lse, num_seqs, num_heads, splits)
    return out


def _check_decode(q, out, k_cache, v_cache, block_tables, seq_lens
                  ) -> tuple[torch.Tensor, int, int]:
    """Checks one-token attention's arguments; returns (out, num_heads, num_kv_heads), `out`
    allocated when None."""
    out = _check_q(q, out)
    _check_cache(k_cache, v_cache, q)
    num_heads, num_kv_heads = _check_heads(q, k_cache)
    _check_group(num_heads, num_kv_heads)
    device, num_seqs = q.device, q.shape[0]
    _check_index("block_tables", block_tables, 2, device)
    _check_index("seq_lens", seq_lens, 1, device)
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(f"q {tuple(q.shape)}, block_tables {tuple(block_tables.shape)} and "
                         f"seq_lens {tuple(seq_lens.shape)} disagree on num_seqs")
    return out, num_heads, num_kv_heads
