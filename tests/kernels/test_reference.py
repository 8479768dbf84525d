"""CPU checks of the torch reference twins (pagedserve_kernels.reference) against dense/naive
float64 implementations on random paged caches with shuffled pages. Runs in CI (no GPU)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import reference as ref


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype=torch.float64, seed=0, extra=3):
    """Random K/V for each sequence scattered over shuffled pages.

    returns k_cache, v_cache [num_blocks, kv_heads, block_size, head_dim], block_tables int32,
    and the dense per-sequence K/V lists [seq_len, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + extra
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g, dtype=dtype)
    width = max(pages) + 2
    block_tables = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)  # unused past pages
    dense_k, dense_v, used = [], [], 0
    for i, n in enumerate(seq_lens):
        ids = perm[used : used + pages[i]]
        used += pages[i]
        block_tables[i, : pages[i]] = ids.to(torch.int32)
        rows_k = k_cache[ids].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:n]
        rows_v = v_cache[ids].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:n]
        dense_k.append(rows_k.clone())
        dense_v.append(rows_v.clone())
    return k_cache, v_cache, block_tables, dense_k, dense_v


def dense_attention(q, k, v, scale):
    """SDPA with an explicit bottom-right causal mask and repeated KV heads (float64)."""
    q_len, num_heads, _ = q.shape
    ctx = k.shape[0]
    group = num_heads // k.shape[1]
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_prefill_matches_dense_sdpa(block_size, heads, kv_heads):
    head_dim = 32
    seq_lens = [1, 17, 64, 45]
    q_lens = [1, 17, 20, 5]  # full prefill, partial (chunked) prefill, single-token tail
    k_cache, v_cache, tables, dk, dv = make_paged(seq_lens, kv_heads, head_dim, block_size, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    scale = head_dim**-0.5
    out = ref.paged_prefill_attention(q, k_cache, v_cache, tables, cu,
                                      torch.tensor(seq_lens, dtype=torch.int32), scale)
    for i in range(len(seq_lens)):
        expect = dense_attention(q[cu[i] : cu[i + 1]], dk[i], dv[i], scale)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], expect, rtol=1e-10, atol=1e-10)


def test_decode_matches_naive_softmax():
    heads, kv_heads, head_dim, block_size = 8, 2, 16, 16
    seq_lens = [1, 15, 16, 17, 100]
    k_cache, v_cache, tables, dk, dv = make_paged(seq_lens, kv_heads, head_dim, block_size, seed=3)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    out = ref.paged_decode_attention(q, k_cache, v_cache, tables,
                                     torch.tensor(seq_lens, dtype=torch.int32), 0.3)
    for s in range(len(seq_lens)):
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            w = torch.softmax((dk[s][:, kvh] @ q[s, h]) * 0.3, dim=0)
            torch.testing.assert_close(out[s, h], w @ dv[s][:, kvh], rtol=1e-10, atol=1e-10)


def test_reshape_and_cache_writes_each_slot():
    num_blocks, kv_heads, block_size, head_dim = 6, 2, 16, 8
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 17, 95, 40, 0], dtype=torch.int64)
    key = torch.randn(len(slots), kv_heads, head_dim, dtype=torch.float64)
    value = torch.randn(len(slots), kv_heads, head_dim, dtype=torch.float64)
    ref.reshape_and_cache(key, value, k_cache, v_cache, slots)
    expect_k, expect_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        for h in range(kv_heads):
            expect_k[slot // block_size, h, slot % block_size] = key[t, h]
            expect_v[slot // block_size, h, slot % block_size] = value[t, h]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_gather_kv_follows_block_table():
    k_cache, _, tables, dk, _ = make_paged([37], 2, 8, 16, seed=5)
    torch.testing.assert_close(ref.gather_kv(k_cache, tables[0], 37), dk[0], rtol=0, atol=0)


def test_swap_and_copy_blocks_move_whole_pages():
    layers, kv_heads, block_size, head_dim = 3, 2, 4, 8
    src_k = torch.randn(layers, 7, kv_heads, block_size, head_dim)
    src_v = torch.randn_like(src_k)
    dst_k = torch.randn(layers, 5, kv_heads, block_size, head_dim)
    dst_v = torch.randn_like(dst_k)
    mapping = torch.tensor([[6, 0], [2, 4], [3, 1]], dtype=torch.int64)
    expect_k, expect_v = dst_k.clone(), dst_v.clone()
    for s, d in mapping.tolist():
        expect_k[:, d], expect_v[:, d] = src_k[:, s], src_v[:, s]
    ref.swap_blocks(src_k, src_v, dst_k, dst_v, mapping)
    assert torch.equal(dst_k, expect_k) and torch.equal(dst_v, expect_v)

    cow = torch.tensor([[0, 5], [1, 6]], dtype=torch.int64)
    expect_k, expect_v = src_k.clone(), src_v.clone()
    expect_k[:, [5, 6]], expect_v[:, [5, 6]] = src_k[:, [0, 1]], src_v[:, [0, 1]]
    ref.copy_blocks(src_k, src_v, cow)
    assert torch.equal(src_k, expect_k) and torch.equal(src_v, expect_v)


def test_block_mapping_shape_is_checked():
    t = torch.zeros(1, 2, 1, 1, 8)
    with pytest.raises(ValueError):
        ref.swap_blocks(t, t, t, t, torch.zeros(3, dtype=torch.int64))
