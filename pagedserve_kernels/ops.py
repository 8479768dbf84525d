"""Launchers of the Llama forward's elementwise kernels (csrc/ops.cu), bf16/fp16, as the reference
twins but in fp32 with one rounding (equal to rounding, not bit for bit), and of a grammar's token
mask and sampling's race on float32 logits; capturable, no syncs. Imports cupy only when launching.
"""
from __future__ import annotations

import torch

from pagedserve_kernels import _compile
from pagedserve_kernels._compile import f32 as _f32, i32 as _i32, i64 as _i64
from pagedserve_kernels.reference import FP8_MIN_SCALE

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_VEC = 8  # 2-byte elements per 16-byte vector: the kernels' vector width
_NORM_MAX_THREADS = 1024
_ROPE_MAX_THREADS = 512
_SILU_THREADS = 256
_MASK_THREADS = 256
_MAX_GRID_Y = 65535
_MAX_GRID_X = 2**31 - 1
_RACE_THREADS = 512  # PS_RACE_THREADS in ops.cu


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), row by row, fp32 inside.

    x: [num_tokens, hidden] bf16/fp16 on the GPU, last dim contiguous (any row stride)
    weight: [hidden] contiguous, x's dtype
    out: [num_tokens, hidden], last dim contiguous, may be x itself; allocated when None
    returns out. One CTA per row.
    """
    _check_rows("x", x)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_rows("out", out, like=x)
    _check_weight(weight, x)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out
    vec = _rows_aligned(hidden, x, out) and weight.data_ptr() % 16 == 0
    args = (out.data_ptr(), _i64(out.stride(0)), x.data_ptr(), _i64(x.stride(0)),
            weight.data_ptr(), _i32(hidden), _f32(eps), _i32(vec))
    threads = _threads(hidden // _VEC if vec else hidden, _NORM_MAX_THREADS)
    _launch(f"rms_norm_{_DTYPES[x.dtype]}", x, (num_tokens, 1, 1), threads, args)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual = to_dtype(residual + x), then x = rms_norm(residual, weight, eps).

    x, residual: [num_tokens, hidden] bf16/fp16 on the GPU, last dim contiguous
    weight: [hidden] contiguous, x's dtype
    returns (x, residual), the same tensors. One CTA per row.
    """
    _check_rows("x", x)
    _check_rows("residual", residual, like=x)
    _check_weight(weight, x)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return x, residual
    vec = _rows_aligned(hidden, x, residual) and weight.data_ptr() % 16 == 0
    args = (x.data_ptr(), _i64(x.stride(0)), residual.data_ptr(), _i64(residual.stride(0)),
            weight.data_ptr(), _i32(hidden), _f32(eps), _i32(vec))
    threads = _threads(hidden // _VEC if vec else hidden, _NORM_MAX_THREADS)
    _launch(f"fused_add_rms_norm_{_DTYPES[x.dtype]}", x, (num_tokens, 1, 1), threads, args)
    return x, residual


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm's rows (with `residual`: fused_add_rms_norm's, residual updated in place)
    quantized for an FP8 W8A8 product with a dynamic scale per token, in one launch: what
    reference.quantize_fp8 makes of this module's rms_norm output, bit for bit. The normed rows
    are never written in x's dtype (x is left as it is).

    x: [num_tokens, hidden] bf16/fp16 on the GPU, last dim contiguous; weight: [hidden]
    residual: like x, or None
    returns (e4m3 [num_tokens, hidden] contiguous, float32 scales [num_tokens, 1]). One CTA per
    row.
    """
    _check_rows("x", x)
    if residual is not None:
        _check_rows("residual", residual, like=x)
    _check_weight(weight, x)
    num_tokens, hidden = x.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, scales
    rows = (x,) if residual is None else (x, residual)
    vec = _rows_aligned(hidden, *rows) and weight.data_ptr() % 16 == 0
    head = (out.data_ptr(), scales.data_ptr(), x.data_ptr(), _i64(x.stride(0)))
    tail = (weight.data_ptr(), _i32(hidden), _f32(eps), _f32(FP8_MIN_SCALE), _i32(vec))
    threads = _threads(hidden // _VEC if vec else hidden, _NORM_MAX_THREADS)
    if residual is None:
        _launch(f"rms_norm_fp8_{_DTYPES[x.dtype]}", x, (num_tokens, 1, 1), threads, head + tail)
    else:
        args = head + (residual.data_ptr(), _i64(residual.stride(0))) + tail
        _launch(f"fused_add_rms_norm_fp8_{_DTYPES[x.dtype]}", x, (num_tokens, 1, 1), threads,
                args)
    return out, scales


def head_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> None:
    """reference.head_rms_norm in place, bit for bit rms_norm on the heads' rows, in one launch
    (one CTA per token, head_dim / 8 threads a head) where head_dim is 64, 128 or 256 and every
    head row is 16-byte aligned; else rms_norm over copies of q and k, written back.

    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], bf16/fp16, last
        dim contiguous, any token/head strides (views of a fused qkv output)
    q_weight, k_weight: [head_dim] of q's dtype, contiguous
    """
    _check_qk(q, k)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if (w.shape != (head_dim,) or w.dtype != q.dtype or w.device != q.device
                or not w.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] of {q.dtype} on "
                             f"{q.device}, got {tuple(w.shape)} {w.dtype} on {w.device}")
    if num_tokens == 0:
        return
    es = q.element_size()
    if head_dim not in (64, 128, 256) or not all(
            t.data_ptr() % 16 == 0 and all(t.stride(d) * es % 16 == 0 for d in range(t.dim() - 1))
            for t in (q, k, q_weight.view(1, -1), k_weight.view(1, -1))):
        for x, weight in ((q, q_weight), (k, k_weight)):
            x.copy_(rms_norm(x.reshape(-1, head_dim), weight, eps).view(x.shape))
        return
    threads = _threads((num_heads + num_kv_heads) * (head_dim // _VEC), _NORM_MAX_THREADS)
    args = (q.data_ptr(), _i64(q.stride(0)), _i64(q.stride(1)), k.data_ptr(), _i64(k.stride(0)),
            _i64(k.stride(1)), q_weight.data_ptr(), k_weight.data_ptr(), _i32(num_heads),
            _i32(num_kv_heads), _i32(head_dim), _f32(eps))
    _launch(f"head_rms_norm_{_DTYPES[q.dtype]}", q, (num_tokens, 1, 1), threads, args)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.quantize_fp8(x) with a dynamic scale per token, bit for bit, in one launch (the
    rows of an FP8 W8A8 product no kernel before it quantized).

    x: [num_tokens, width] bf16/fp16 on the GPU, last dim contiguous (any row stride)
    returns (e4m3 [num_tokens, width] contiguous, float32 scales [num_tokens, 1]). One CTA per
    row: its amax, then its bytes.
    """
    _check_rows("x", x)
    return _quantized_rows("quantize_fp8", x, x.shape[1])


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """RoPE in place on q and k in one launch, on the first rotary_dim = cos_table.shape[1]
    elements of each head (the rest pass through); rotate-half (HF/neox) pairs (i, i +
    rotary_dim / 2), or with `interleaved` the pairs (2i, 2i + 1) at frequency i (GLM). fp32
    math, table values used unrounded.

    positions: [num_tokens] int64, contiguous; a position outside [0, max_pos) leaves its token's
        rows unchanged (checking would need a host sync)
    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], bf16/fp16,
        last dim contiguous, any token/head strides (views of a fused qkv output)
    cos_table, sin_table: [max_pos, rotary_dim] float32, contiguous, rows cat(f, f) over the
        rotary_dim / 2 frequencies f; rotary_dim even, at most head_dim
    One CTA per token.
    """
    _check_rope(positions, q, k, cos_table, sin_table)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    rotary_dim = cos_table.shape[1]
    vec = _rope_vec(q, k, cos_table, sin_table)
    units = (num_heads + num_kv_heads) * (rotary_dim // 2 // (_VEC if vec else 1))
    args = (positions.data_ptr(), q.data_ptr(), _i64(q.stride(0)), _i64(q.stride(1)),
            k.data_ptr(), _i64(k.stride(0)), _i64(k.stride(1)), cos_table.data_ptr(),
            sin_table.data_ptr(), _i32(num_heads), _i32(num_kv_heads), _i32(rotary_dim),
            _i32(bool(interleaved)), _i64(cos_table.shape[0]), _i32(vec))
    _launch(f"rotary_embedding_{_DTYPES[q.dtype]}", q, (num_tokens, 1, 1),
            _threads(units, _ROPE_MAX_THREADS), args)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    value: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """rotary_embedding(positions, q, k, cos_table, sin_table, interleaved), then
    cache_ops.reshape_and_cache(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale), with
    the same results bit for bit; one launch (one CTA per token) where every row is whole 16-byte
    vectors (rotary_dim a multiple of 16, q/k rows and the tables 16-byte aligned), else those two
    launches.
    Arguments as theirs: value [num_tokens, num_kv_heads, head_dim] with k's dtype; caches
    [num_blocks, num_kv_heads, block_size, head_dim] contiguous (one layer), of k's dtype or FP8
    (then k_scale / v_scale, the layer's, as cache_ops.kv_scale_args); slot_mapping int64 or
    int32, a negative slot caches nothing for its token (q and k are still rotated)."""
    from pagedserve_kernels import cache_ops

    _check_rope(positions, q, k, cos_table, sin_table)
    cache_ops.check_cache_write(k, value, k_cache, v_cache, slot_mapping)
    scales = cache_ops.kv_scale_args(k_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if not (_rope_vec(q, k, cos_table, sin_table)
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0):
        rotary_embedding(positions, q, k, cos_table, sin_table, interleaved)
        cache_ops.reshape_and_cache(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if num_tokens == 0:
        return
    rotary_dim = cos_table.shape[1]
    units = max((num_heads + num_kv_heads) * (rotary_dim // 2 // _VEC),
                num_kv_heads * head_dim // _VEC)  # the latter: more kv than q heads, or partial
    index = "i64" if slot_mapping.dtype == torch.int64 else "i32"
    args = (positions.data_ptr(), q.data_ptr(), _i64(q.stride(0)), _i64(q.stride(1)),
            k.data_ptr(), _i64(k.stride(0)), _i64(k.stride(1)), value.data_ptr(),
            _i64(value.stride(0)), _i64(value.stride(1)), cos_table.data_ptr(),
            sin_table.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
            _i32(num_heads), _i32(num_kv_heads), _i32(head_dim), _i32(rotary_dim),
            _i32(bool(interleaved)), _i64(cos_table.shape[0]), _i64(k_cache.shape[2]), *scales)
    kernel = f"rotary_embedding_cache_{_DTYPES[q.dtype]}_{index}"
    threads = _threads(units, _ROPE_MAX_THREADS)
    if scales:  # an FP8 cache: its kernel is in the FP8 cache's module (_compile.LAZY)
        _compile.launch("kv_fp8", f"{kernel}_fp8", q.device, (num_tokens, 1, 1), (threads, 1, 1),
                        args)
    else:
        _launch(kernel, q, (num_tokens, 1, 1), threads, args)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(gate) * up with gate, up = x.chunk(2, -1); fp32 math, one rounding.

    x: [num_tokens, 2 * d] bf16/fp16 on the GPU (gate | up), last dim contiguous
    out: [num_tokens, d], last dim contiguous; allocated when None. returns out
    Grid (tokens, chunks of the row).
    """
    _check_rows("x", x)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x must be [num_tokens, 2 * d] (gate | up), got width {width}")
    d = width // 2
    if out is None:
        out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    _check_rows("out", out)
    if out.shape != (num_tokens, d) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be ({num_tokens}, {d}) {x.dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if num_tokens == 0 or d == 0:
        return out
    vec = _rows_aligned(d, x, out)
    units = d // _VEC if vec else d
    threads = _threads(units, _SILU_THREADS)
    chunks = (units + threads - 1) // threads
    if chunks > _MAX_GRID_Y:
        raise ValueError(f"rows of {d} outputs are too wide for one launch")
    args = (out.data_ptr(), _i64(out.stride(0)), x.data_ptr(), _i64(x.stride(0)), _i32(d),
            _i32(vec))
    _launch(f"silu_and_mul_{_DTYPES[x.dtype]}", x, (num_tokens, chunks, 1), threads, args)
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul's rows quantized for an FP8 W8A8 product with a dynamic scale per token, in
    one launch: reference.quantize_fp8 of this module's silu_and_mul(x), bit for bit, the rows
    never written in x's dtype.

    x: [num_tokens, 2 * d] bf16/fp16 on the GPU (gate | up), last dim contiguous (any row stride)
    returns (e4m3 [num_tokens, d] contiguous, float32 scales [num_tokens, 1]). One CTA per row.
    """
    _check_rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * d] (gate | up), got width {x.shape[1]}")
    # vectors where d is whole ones: up's rows start 2 * d bytes into x's
    return _quantized_rows("silu_and_mul_fp8", x, x.shape[1] // 2)


def _quantized_rows(kernel: str, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [num_tokens, width], float32 scales [num_tokens, 1]) from `kernel`, one CTA per row
    of x quantizing `width` values (x's own, or made from them) per token."""
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, width, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, scales
    vec = _rows_aligned(width, x)
    args = (out.data_ptr(), scales.data_ptr(), x.data_ptr(), _i64(x.stride(0)), _i32(width),
            _f32(FP8_MIN_SCALE), _i32(vec))
    threads = _threads(width // _VEC if vec else width, _NORM_MAX_THREADS)
    _launch(f"{kernel}_{_DTYPES[x.dtype]}", x, (num_tokens, 1, 1), threads, args)
    return out, scales


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | None = None) -> None:
    """In place: logits[indices[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is clear
    (reference.apply_token_bitmask's contract, bit for bit): one pass over the masked rows.

    logits: [n, vocab] float32 on the GPU, last dim contiguous (any row stride)
    bitmask: [m, words] int32, words >= ceil(vocab / 32), last dim contiguous (any row stride)
    indices: [m] int64, contiguous: rows of logits, distinct among those in [0, n); an index
        outside [0, n) masks nothing (a graph's padding rows). None: m == n, row i
    Grid (chunks of the vocabulary, m); capturable, no syncs.
    """
    _check_device("logits", logits)
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [n, vocab] float32 with a contiguous last dim, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    n, vocab = logits.shape
    if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device != logits.device
            or (bitmask.shape[1] > 1 and bitmask.stride(1) != 1)):
        raise ValueError(f"bitmask must be [m, words] int32 on {logits.device} with a contiguous "
                         f"last dim, got {bitmask.dtype} {tuple(bitmask.shape)} on "
                         f"{bitmask.device}")
    m, words = bitmask.shape
    if words * 32 < vocab:
        raise ValueError(f"bitmask of {words} words cannot cover {vocab} tokens")
    if indices is None:
        if m != n:
            raise ValueError(f"without indices the bitmask needs a row per logits row ({n}), "
                             f"got {m}")
    elif (indices.dtype != torch.int64 or indices.shape != (m,) or not indices.is_contiguous()
          or indices.device != logits.device):
        raise ValueError(f"indices must be a contiguous [{m}] int64 tensor on {logits.device}, "
                         f"got {indices.dtype} {tuple(indices.shape)} on {indices.device}")
    if m > _MAX_GRID_Y:
        raise ValueError(f"{m} bitmask rows exceed one launch's {_MAX_GRID_Y}")
    if m == 0 or vocab == 0:
        return
    args = (logits.data_ptr(), _i64(logits.stride(0)), bitmask.data_ptr(),
            _i64(bitmask.stride(0)), 0 if indices is None else indices.data_ptr(), _i64(n),
            _i32(vocab))
    chunks = (vocab + _MASK_THREADS - 1) // _MASK_THREADS
    _launch("apply_token_bitmask", logits, (chunks, m, 1), _MASK_THREADS, args)


def gumbel_argmax(scores: torch.Tensor, row_seeds: torch.Tensor) -> torch.Tensor:
    """[n] int64: argmax over t of scores[i, t] + g, g = -log(max(-log(u), FLT_MIN)), u the
    splitmix64 noise of row_seeds[i] at t (executor_svc.sampler's race_argmax on the host ops,
    bit for bit, ties and NaN to the first index as torch.argmax); nothing [n, vocab] written.

    scores: [n, vocab] float32 on the GPU, last dim contiguous (any row stride)
    row_seeds: [n] int64, contiguous, on the same device
    One CTA per row; capturable, no syncs.
    """
    _check_device("scores", scores)
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(f"scores must be [n, vocab] float32 with a contiguous last dim, got "
                         f"{scores.dtype} {tuple(scores.shape)} strides {scores.stride()}")
    n, vocab = scores.shape
    if (row_seeds.dtype != torch.int64 or row_seeds.shape != (n,)
            or not row_seeds.is_contiguous() or row_seeds.device != scores.device):
        raise ValueError(f"row_seeds must be a contiguous [{n}] int64 tensor on {scores.device}, "
                         f"got {row_seeds.dtype} {tuple(row_seeds.shape)} on {row_seeds.device}")
    if not 0 < vocab < 2**30:  # the kernel's int index strides past it by a block
        raise ValueError(f"a vocabulary of {vocab} tokens is out of the kernel's range")
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    if n == 0:
        return out
    if n > _MAX_GRID_X:
        raise ValueError(f"{n} rows exceed one launch's {_MAX_GRID_X}")
    args = (scores.data_ptr(), _i64(scores.stride(0)), row_seeds.data_ptr(), out.data_ptr(),
            _i32(vocab))
    _launch("gumbel_argmax", scores, (n, 1, 1), _RACE_THREADS, args)
    return out


# -- validation ------------------------------------------------------------------------------------

def _check_device(name: str, t: torch.Tensor) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """A [rows, width] bf16/fp16 GPU tensor with a contiguous last dim (and `like`'s shape,
    dtype and device)."""
    _check_device(name, t)
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype} (other dtypes run "
                         f"through pagedserve_kernels.reference)")
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be [num_tokens, width] with a contiguous last dim, got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")
    if like is not None and (t.shape != like.shape or t.dtype != like.dtype
                             or t.device != like.device):
        raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if (weight.dim() != 1 or weight.shape[0] != x.shape[1] or weight.dtype != x.dtype
            or weight.device != x.device or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}] {x.dtype} tensor on "
                         f"{x.device}, got {tuple(weight.shape)} {weight.dtype} on {weight.device}")


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        _check_device(name, t)
        if t.dtype not in _DTYPES or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"q and k must share one dtype (bfloat16 or float16) and device, got "
                             f"{q.dtype} on {q.device} and {k.dtype} on {k.device}")
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"{name} must be [num_tokens, heads, head_dim] with a contiguous last "
                             f"dim, got shape {tuple(t.shape)} strides {t.stride()}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same number of "
                         f"tokens and the same head_dim")


def _check_rope(positions, q, k, cos_table, sin_table) -> None:
    _check_qk(q, k)
    head_dim = q.shape[2]
    _check_positions(positions, q.shape[0], q.device)
    for name, t in (("cos_table", cos_table), ("sin_table", sin_table)):
        if (t.dtype != torch.float32 or t.dim() != 2 or not t.is_contiguous()
                or t.device != q.device or t.shape != cos_table.shape):
            raise ValueError(f"{name} must be a contiguous [max_pos, rotary_dim] float32 tensor "
                             f"on {q.device} (both tables alike), got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    rotary_dim = cos_table.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"the tables' width (rotary_dim) must be even and in [2, head_dim = "
                         f"{head_dim}], got {rotary_dim}")


def _rope_vec(q, k, cos_table, sin_table) -> bool:
    """Whether RoPE can take the 16-byte vector path: halves of the rotated span whole vectors,
    q/k rows and the tables 16-byte aligned."""
    es = q.element_size()
    return (cos_table.shape[1] % (2 * _VEC) == 0
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0
                    and (t.stride(1) * es) % 16 == 0 for t in (q, k))
            and cos_table.data_ptr() % 16 == 0 and sin_table.data_ptr() % 16 == 0)


def _check_positions(positions: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if (positions.dtype != torch.int64 or positions.dim() != 1 or positions.shape[0] != num_tokens
            or positions.device != device or not positions.is_contiguous()):
        raise ValueError(f"positions must be a contiguous [{num_tokens}] int64 tensor on {device}, "
                         f"got {positions.dtype} {tuple(positions.shape)} on {positions.device}")


def _rows_aligned(width: int, *tensors: torch.Tensor) -> bool:
    """Whether every row of every tensor starts 16-byte aligned and holds whole 16-byte vectors:
    the condition for the kernels' vector path."""
    if width % _VEC:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


# -- launch ------------------------------------------------------------------------------------

def _threads(units: int, cap: int) -> int:
    """A multiple of 32 (the block reduction needs whole warps), at most `cap`."""
    return min(cap, max(32, (units + 31) // 32 * 32))


def _launch(kernel: str, like: torch.Tensor, grid: tuple[int, int, int], threads: int,
            args: tuple) -> None:
    _compile.launch("ops", kernel, like.device, grid, (threads, 1, 1), args)
