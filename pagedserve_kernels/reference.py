"""Torch reference twins of the CUDA kernels, same signatures and KV layout (K and V each
[num_layers, num_blocks, num_kv_heads, block_size, head_dim]; slot = block_id * block_size +
offset): the CPU backend runs on these, GPU tests hold the kernels to them. Imports torch only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


KV_FP8 = torch.float8_e4m3fn  # the FP8 KV cache's element type (--kv-cache-dtype fp8)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """K or V rows to the FP8 cache, as vLLM's cache kernels: x / scale in float32, saturated
    at +-448, rounded to nearest e4m3. scale: [] float32, the layer's k_scale or v_scale (None:
    1.0)."""
    xf = x.float() if scale is None else x.float() / scale
    return xf.clamp(-FP8_MAX, FP8_MAX).to(KV_FP8)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """FP8 cache rows back to float32: x * scale (None: 1.0)."""
    return x.float() if scale is None else x.float() * scale


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return quantize_kv(x, scale) if cache.dtype == KV_FP8 else x.to(cache.dtype)


def _from_cache(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows as attention reads them: FP8 dequantized to float32, any other dtype as is."""
    return dequantize_kv(rows, scale) if rows.dtype == KV_FP8 else rows


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new K and V rows into their cache slots.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (one layer), the model's
        dtype or float8_e4m3fn (then each row is quantize_kv'd with k_scale / v_scale)
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a negative slot
        (a padding token of a graph's batch) writes nothing, as in the kernel
    k_scale, v_scale: [] float32 per-layer scales of an FP8 cache (None: 1.0); other caches
        ignore them
    """
    block_size = k_cache.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0  # [num_tokens]
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_ids = slots // block_size
    offsets = slots % block_size
    # Advanced indexing on dims 0 and 2 puts the token dim first: [num_tokens, num_kv_heads, head_dim].
    k_cache[block_ids, :, offsets] = _to_cache(key, k_cache, k_scale)
    v_cache[block_ids, :, offsets] = _to_cache(value, v_cache, v_scale)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """One sequence's first `seq_len` cached rows: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]  # [nb, kv_heads, block_size, head_dim]
    rows = pages.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])
    return rows[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of the last q_len positions of a context of len(k) rows; with
    `sliding_window` W a query sees the W most recent positions (itself included), with
    `soft_cap` c the scaled scores become c * tanh(score / c) before the mask (Gemma 2).

    q: [q_len, num_heads, head_dim]; k, v: [ctx_len, num_kv_heads, head_dim] -> [q_len, num_heads, head_dim]
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.to(compute).transpose(0, 1)  # [heads, q_len, hd]
    kf = k.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, ctx, hd]
    vf = v.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [heads, q_len, ctx]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(ctx_len, device=q.device).unsqueeze(0)
    hidden = k_pos > q_pos  # [q_len, ctx]
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1)  # [q_len, heads, hd]


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
) -> torch.Tensor:
    """Causal attention of new query tokens over everything cached for their sequence.

    q: [total_q_tokens, num_heads, head_dim], sequences packed back to back
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (one layer, the new
        tokens' K/V already written)
    block_tables: [num_seqs, max_blocks_per_seq] int32 (entries past a sequence's pages unused)
    cu_seqlens_q: [num_seqs + 1] int32, query offsets into q
    seq_lens: [num_seqs] int32, context length per sequence including its new tokens; query i of
        a sequence with q_len new tokens sits at position seq_len - q_len + i
    sliding_window: None (full attention) or W: a query sees only the W most recent positions
    soft_cap: None or c: scores (after `scale`) pass through c * tanh(score / c)
    k_scale, v_scale: an FP8 cache's per-layer scales (reshape_and_cache's): its rows are read
        dequantized to float32
    returns out: [total_q_tokens, num_heads, head_dim] in q's dtype
    """
    if out is None:
        out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs = q[starts[i] : starts[i + 1]]
        if qs.shape[0] == 0:
            continue
        k = _from_cache(gather_kv(k_cache, block_tables[i], seq_len), k_scale)
        v = _from_cache(gather_kv(v_cache, block_tables[i], seq_len), v_scale)
        out[starts[i] : starts[i + 1]] = _attend(qs, k, v, scale, sliding_window, soft_cap).to(out.dtype)
    return out


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
) -> torch.Tensor:
    """One query token per sequence (the last position) over its pages.

    q: [num_seqs, num_heads, head_dim]; seq_lens: [num_seqs] int32 including the new token;
    other arguments as paged_prefill_attention. returns out: [num_seqs, num_heads, head_dim]
    """
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    return paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                   out, sliding_window, soft_cap, k_scale, v_scale)


def torch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None,
                           sliding_window=None, soft_cap=None, k_scale=None, v_scale=None):
    """Decode attention with torch ops only and no host sync (capturable in a CUDA graph).

    q: [num_seqs, num_heads, head_dim]; caches [num_blocks, kv_heads, block_size, head_dim];
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32; sliding_window,
    soft_cap, k_scale, v_scale: paged_prefill_attention's. Reads every listed page (max_blocks of
    them per row), so it suits small models only.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tables = block_tables.long()

    def gather(cache):  # -> [num_seqs, kv_heads, max_blocks * block_size, head_dim]
        pages = cache[tables]  # [num_seqs, max_blocks, kv_heads, block_size, head_dim]
        return pages.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, -1, head_dim)

    k = _from_cache(gather(k_cache), k_scale).float()
    v = _from_cache(gather(v_cache), v_scale).float()
    ctx = torch.arange(k.shape[2], device=q.device)
    # Rows past a sequence's length come from pages it does not own (stale table columns, the
    # unwritten end of its last page): they may hold anything, NaN included, and 0 * NaN is NaN,
    # so they are zeroed, not only given zero weight.
    v = v.masked_fill((ctx.view(1, 1, -1, 1) >= seq_lens.view(-1, 1, 1, 1)), 0.0)
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,sktd->skgt", qf, k) * scale  # [seqs, kv_heads, group, ctx]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    valid = ctx.view(1, 1, 1, -1) < seq_lens.view(-1, 1, 1, 1)
    if sliding_window is not None:  # the query sits at seq_len - 1
        valid &= ctx.view(1, 1, 1, -1) >= seq_lens.view(-1, 1, 1, 1) - sliding_window
    probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)
    result = torch.einsum("skgt,sktd->skgd", probs, v).reshape(num_seqs, num_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def _check_mapping(block_mapping: torch.Tensor) -> torch.Tensor:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}")
    return block_mapping.to(device="cpu", dtype=torch.long)


def swap_blocks(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole pages between two caches (GPU <-> CPU swap space), all layers, K and V, as
    they are (an FP8 page moves its bytes, never requantized).

    src_*, dst_*: [num_layers, num_blocks, num_kv_heads, block_size, head_dim] (block counts may differ)
    block_mapping: [n, 2] int64 pairs (src_block, dst_block)
    """
    mapping = _check_mapping(block_mapping)
    if mapping.shape[0] == 0:
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    dst_k[:, dst.to(dst_k.device)] = src_k[:, src.to(src_k.device)].to(dst_k.device)
    dst_v[:, dst.to(dst_v.device)] = src_v[:, src.to(src_v.device)].to(dst_v.device)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy pages within one cache (copy-on-write), all layers, K and V.

    k_cache, v_cache: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]
    block_mapping: [n, 2] int64 pairs (src_block, dst_block); no block is both a source and a destination
    """
    swap_blocks(k_cache, v_cache, k_cache, v_cache, block_mapping)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, round to x's dtype, scale by weight
    in that dtype. x: [num_tokens, hidden]; weight: [hidden]; returns out [num_tokens, hidden]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    result = weight * xf.to(x.dtype)
    if out is None:
        return result
    return out.copy_(result)


def head_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> None:
    """In place: rms_norm over every head's row of q [T, heads, hd] and k [T, kv_heads, hd]
    (views of a fused qkv output allowed) with the per-head weights [hd]: Qwen3's and Gemma 3's
    q_norm / k_norm."""
    for x, weight in ((q, q_weight), (k, k_weight)):
        x.copy_(rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x (rounded to the dtype, as transformers' `residual + hidden`), then
    x = rms_norm(residual). x, residual: [num_tokens, hidden]; returns (x, residual)."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))
    return x, residual


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """RoPE in place, as transformers: cos/sin rounded to q's dtype, then x * cos +
    rotate(x) * sin in that dtype, on the first rotary_dim = cos_table.shape[1] dims of each head
    (partial rotary when below head_dim; the rest pass through). Rotate-half (HF/neox) pairs
    (i, i + rotary_dim / 2) by default; `interleaved` pairs (2i, 2i + 1), as GLM.

    positions: [num_tokens] int64; q: [num_tokens, num_heads, head_dim], k: [num_tokens,
    num_kv_heads, head_dim] (may be strided views); cos_table, sin_table: [max_pos, rotary_dim]
    float32, each row cat(f, f) over the rotary_dim / 2 frequencies f
    """
    rotary_dim = cos_table.shape[1]
    cos = cos_table[positions].to(q.dtype).unsqueeze(1)  # [num_tokens, 1, rotary_dim]
    sin = sin_table[positions].to(q.dtype).unsqueeze(1)
    rotate = _rotate
    if interleaved:  # each frequency once, repeated for the two members of its pair
        cos = cos[..., : rotary_dim // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : rotary_dim // 2].repeat_interleave(2, dim=-1)
        rotate = _rotate_interleaved
    q[..., :rotary_dim] = rotate(q[..., :rotary_dim], cos, sin)
    k[..., :rotary_dim] = rotate(k[..., :rotary_dim], cos, sin)


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
    """rotary_embedding(positions, q, k, ...), then reshape_and_cache(k, value, ...): the rotated
    k and value written to their cache slots (the CUDA kernel does both in one launch)."""
    rotary_embedding(positions, q, k, cos_table, sin_table, interleaved)
    reshape_and_cache(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return x * cos + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up in x's dtype, gate, up = x.chunk(2, -1). x: [num_tokens, 2 * d];
    returns out [num_tokens, d]."""
    gate, up = x.chunk(2, dim=-1)
    result = F.silu(gate) * up
    if out is None:
        return result
    return out.copy_(result)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up in x's dtype (GeGLU, Gemma), gate, up = x.chunk(2, -1).
    x: [num_tokens, 2 * d]; returns out [num_tokens, d]."""
    gate, up = x.chunk(2, dim=-1)
    result = F.gelu(gate, approximate="tanh") * up
    if out is None:
        return result
    return out.copy_(result)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """The int4 kernel's weight, exactly, in float32: W = (q - zero) * scale per group.

    qweight: [K / 8, N] int32, nibble j (bits 4j..4j+3) of word r holds row 8r + j (0..15)
    scales: [K / group_size, N]; zeros: [K / group_size, N] uint8, or None for 8 (symmetric)
    returns [N, K] float32, its rows in qweight's order (the product permutes x to match)
    """
    shifts = torch.arange(8, dtype=torch.int32, device=qweight.device).view(1, 8, 1) * 4
    q = ((qweight.unsqueeze(1) >> shifts) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    group = torch.arange(q.shape[0], device=q.device) // group_size  # [K]
    zero = 8.0 if zeros is None else zeros[group].float()
    return ((q.float() - zero) * scales[group].float()).t()  # [N, K]


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, group_size: int, perm: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A16: x [T, K] (bf16/fp16/fp32) times the int4 weight (dequantize_int4's arguments) ->
    [T, N] in x's dtype. perm: [K], the act-order input order (x[:, perm]); None keeps x's."""
    weight = dequantize_int4(qweight, scales, zeros, group_size).to(x.dtype)  # [N, K]
    if perm is not None:
        x = x.index_select(-1, perm)
    return F.linear(x, weight, bias)


FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a dynamic scale (an all-zero row)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None,
                 per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scale [T, 1] per token or [1, 1]) with x ~ q * scale;
    a given `scale` (static) is used as is. vLLM's rule: scale = max(amax / 448, floor),
    q = clamp(x * (1 / scale), +-448) rounded to nearest."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().view(1, 1)
        # A true division (a tensor divisor): by a Python number torch's CUDA kernel multiplies
        # by its reciprocal, which differs in the last bit from vLLM's and our kernels' division.
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    else:
        scale = scale.float().view(1, 1)
    q = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, per_token: bool = True,
               bias: torch.Tensor | None = None,
               block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """FP8 W8A8: x [T, K] quantized to e4m3 (quantize_fp8: dynamic per token or per tensor, or
    static with input_scale []), times weight [N, K] e4m3 with weight_scale [N] float32; the
    products summed in float32, both scales and the bias applied there, then rounded to x's
    dtype (a scaled GEMM's epilogue) -> [T, N]. block_size (bn, bk): weight_scale is
    [ceil(N / bn), K / bk] and x takes a dynamic scale per token and bk inputs."""
    if block_size is not None:
        return _fp8_block_linear(x, weight, weight_scale, block_size, bias)
    xq, x_scale = quantize_fp8(x, input_scale, per_token)
    return fp8_scaled_linear(xq, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_scaled_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear past its quantization: e4m3 xq [T, K] with x_scale [T, 1] (or [1, 1]) times
    weight [N, K] e4m3 with weight_scale [N], summed in float32, scales and bias applied there,
    rounded to out_dtype -> [T, N]."""
    out = (xq.float() @ weight.float().t()) * x_scale * weight_scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm's rows (with `residual`: residual += x first, in place, and its rows normed, as
    fused_add_rms_norm) quantized per token for an FP8 W8A8 product: quantize_fp8 of the normed
    rows in x's dtype, which the norm never writes (x is left as it is). Returns (e4m3 [T, H],
    float32 scales [T, 1])."""
    if residual is not None:
        residual.add_(x)
        x = residual
    return quantize_fp8(rms_norm(x, weight, eps))


def _fp8_block_linear(x, weight, weight_scale, block_size, bias):
    """Block-wise FP8: each [bn, bk] block's partial products scaled by its weight scale and the
    token's scale of those bk inputs, summed in float32."""
    (n, k), (bn, bk) = weight.shape, block_size
    groups = x.reshape(x.shape[0], k // bk, bk)  # [T, K / bk, bk]
    xq, x_scale = quantize_fp8(groups.reshape(-1, bk))  # per token and group: [T * K / bk, 1]
    xs = (xq.float() * x_scale).reshape(x.shape[0], k)  # [T, K]
    ws = weight_scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)  # [N, K]
    out = xs @ (weight.float() * ws).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | None = None) -> None:
    """In place: logits[indices[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is 0 (a
    grammar's disallowed tokens). logits: [n, vocab] float; bitmask: [m, ceil(vocab / 32)] int32,
    bit j of a word the token 32 * word + j (llguidance's and xgrammar's layout); indices: [m]
    int64 rows of logits, distinct among those in [0, n); an index outside [0, n) masks nothing
    (a graph's padding rows). None: m == n, row i. No host sync."""
    n, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words cannot cover {vocab} tokens")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [m, words, 32]
    disallowed = (bits == 0).reshape(bitmask.shape[0], -1)[:, :vocab]  # [m, vocab]
    if indices is None:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    # Padding rows land in a scratch row past the logits, so no sync picks them out.
    target = torch.where((indices >= 0) & (indices < n), indices, n)  # [m]
    dense = torch.zeros(n + 1, vocab, dtype=torch.bool, device=logits.device)  # [n + 1, vocab]
    dense.index_copy_(0, target, disallowed)
    logits.masked_fill_(dense[:n], float("-inf"))
