"""CPU checks of the elementwise reference twins (pagedserve_kernels.reference: rms_norm,
fused_add_rms_norm, rotary_embedding, silu_and_mul): bit for bit the formulas
executor_svc/models/llama.py used before they became backend ops (copied below as the oracle), in
every dtype the CPU backend serves, in place where the op is in place. Runs in CI (no GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
EPS = 1e-5


# -- the oracle: llama.py's formulas before the backend ops (transformers' numerics) -------------

def unfused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def unfused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim], already in x's dtype."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def unfused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(max_pos: int, head_dim: int, theta: float = 10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim] float32
    return emb.cos(), emb.sin()


def _randn(*shape, seed, dtype):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


# -- tests ----------------------------------------------------------------------------------------

def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (13, 576), (5, 100)])
def test_rms_norm_is_the_unfused_formula(dtype, num_tokens, hidden):
    x = _randn(num_tokens, hidden, seed=1, dtype=dtype)
    weight = _randn(hidden, seed=2, dtype=dtype)
    expect = unfused_rms_norm(x, weight, EPS)
    assert _same(ref.rms_norm(x, weight, EPS), expect)
    out = torch.full_like(x, float("nan"))
    assert ref.rms_norm(x, weight, EPS, out=out) is out and _same(out, expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (13, 576), (5, 100)])
def test_fused_add_rms_norm_is_add_then_norm_in_place(dtype, num_tokens, hidden):
    x = _randn(num_tokens, hidden, seed=3, dtype=dtype)
    residual = _randn(num_tokens, hidden, seed=4, dtype=dtype)
    weight = _randn(hidden, seed=5, dtype=dtype)
    h = residual + x  # the model's `h = h + attn_out`, rounded to the dtype
    expect = unfused_rms_norm(h, weight, EPS)
    x_out, residual_out = ref.fused_add_rms_norm(x, residual, weight, EPS)
    assert x_out is x and residual_out is residual
    assert _same(residual, h) and _same(x, expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64)])
def test_rotary_embedding_rotates_views_of_qkv_in_place(dtype, heads, kv_heads, head_dim):
    num_tokens, max_pos = 11, 300
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, seed=6, dtype=dtype)
    cos_table, sin_table = rope_tables(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=torch.Generator().manual_seed(7))
    before = qkv.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    # The model used to cast the rows of the tables once per step, then rotate copies.
    cos, sin = cos_table[positions].to(dtype), sin_table[positions].to(dtype)
    expect_q = unfused_rope(before[:, :q_size].view(num_tokens, heads, head_dim), cos, sin)
    expect_k = unfused_rope(before[:, q_size:q_size + kv_size].view(num_tokens, kv_heads, head_dim),
                            cos, sin)
    assert ref.rotary_embedding(positions, q, k, cos_table, sin_table) is None
    assert _same(q, expect_q) and _same(k, expect_k)
    assert _same(v, before[:, q_size + kv_size:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_and_cache_caches_the_rotated_k_and_v(dtype):
    num_tokens, heads, kv_heads, head_dim, block_size, max_pos = 9, 4, 2, 16, 4, 64
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, seed=11, dtype=dtype)
    before = qkv.clone()
    q, k, v = (t.view(num_tokens, -1, head_dim)
               for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    k_cache = torch.zeros(4, kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 0, -1, 15, 7, 2, 9, 12, 3])
    cos_table, sin_table = rope_tables(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=torch.Generator().manual_seed(2))
    cos, sin = cos_table[positions].to(dtype), sin_table[positions].to(dtype)
    expect_k = unfused_rope(before[:, q_size:q_size + kv_size].view(num_tokens, kv_heads, head_dim),
                            cos, sin)
    ref.rotary_embedding_and_cache(positions, q, k, v, cos_table, sin_table, k_cache, v_cache,
                                   slots)
    assert _same(k, expect_k)
    for tok, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert _same(k_cache[slot // block_size, :, slot % block_size], expect_k[tok])
            assert _same(v_cache[slot // block_size, :, slot % block_size], v[tok])
    assert int((k_cache.abs().sum(dim=(1, 3)) > 0).sum()) == num_tokens - 1  # slot -1: nothing


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_unfused_formula(dtype):
    gate_up = _randn(9, 2 * 96, seed=8, dtype=dtype)
    expect = unfused_silu_and_mul(gate_up)
    assert _same(ref.silu_and_mul(gate_up), expect)
    out = torch.full((9, 96), float("nan"), dtype=dtype)
    assert ref.silu_and_mul(gate_up, out=out) is out and _same(out, expect)
