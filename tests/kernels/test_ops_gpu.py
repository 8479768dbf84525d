"""The elementwise CuPy kernels (pagedserve_kernels.ops: RMSNorm, fused add + RMSNorm, RoPE,
SiLU-and-mul) against float64 references on the GPU.

Row by row, ||kernel - ref64|| / ||ref64|| must stay within 2x the same error of torch doing the
computation in the kernel's dtype (the reference twins, i.e. transformers' numerics), plus a 1e-3
floor (for RoPE over each head's rotated span; the unrotated tail must come out bit for bit).
Out-of-place outputs are poisoned with NaN first; in-place ones are checked row by row (an
unwritten row keeps its input, far from the reference) and their neighbours in the fused qkv
buffer must be untouched. Fresh random inputs per case; the 16-byte vector path and the scalar
fallback (misaligned rows, widths not a multiple of 8) are both swept.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import reference as ref
from tests.gpu import gpu_ready
from tests.kernels.test_kernels_gpu import FLOOR, capture, seed_of

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-5
TOKENS = [1, 7, 64, 300]
MAX_POS = 8192


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]


@pytest.fixture(scope="module")
def ops():
    from pagedserve_kernels import _compile, ops

    _compile.warmup()
    return ops


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def rows_within(out: torch.Tensor, ref64: torch.Tensor, base: torch.Tensor, what: str) -> None:
    """Per row (last dim): kernel error <= 2 x torch-in-dtype error + FLOOR, and all finite."""
    assert torch.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    width = ref64.shape[-1]
    out, ref64, base = (t.reshape(-1, width).double() for t in (out, ref64, base))
    norm = ref64.norm(dim=-1).clamp_min(1e-30)
    err = (out - ref64).norm(dim=-1) / norm
    base_err = (base - ref64).norm(dim=-1) / norm
    bad = err > 2 * base_err + FLOOR
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {len(err)} rows off; row {row}: "
                             f"{err[row]:.2e} vs torch {base_err[row]:.2e}")


def rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope_tables(rotary_dim: int, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [MAX_POS, rotary_dim] float32, rows cat(f, f), built as LlamaModel builds them."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def rope64(x, positions, cos_table, sin_table, interleaved=False):
    """The rotated span [..., :rotary_dim] of x in float64 (the reference twin's formula)."""
    rotary_dim = cos_table.shape[1]
    cos = cos_table[positions].double().unsqueeze(1)
    sin = sin_table[positions].double().unsqueeze(1)
    x = x[..., :rotary_dim].double()
    if interleaved:
        cos = cos[..., :rotary_dim // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., :rotary_dim // 2].repeat_interleave(2, dim=-1)
        return x * cos + torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) * sin
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotated_within(out, x_in, base, positions, cos_table, sin_table, interleaved, what):
    """out (the kernel's) against float64 on each head's rotated span, rows_within's bound with
    base (the twin's); the span past rotary_dim still x_in, bit for bit."""
    rotary_dim = cos_table.shape[1]
    assert torch.equal(out[..., rotary_dim:], x_in[..., rotary_dim:]), f"{what}: tail changed"
    rows_within(out[..., :rotary_dim], rope64(x_in, positions, cos_table, sin_table, interleaved),
                base[..., :rotary_dim], what)


def silu_and_mul64(x):
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rows_view(num_tokens, width, dtype, gen, offset=0, pad=8):
    """[num_tokens, width] view of a [num_tokens, offset + width + pad] buffer: rows strided, still
    16-byte aligned when offset is 0 and width a multiple of 8; offset 1 puts every row 2 bytes
    past a 16-byte boundary (the scalar path)."""
    buf = randn(num_tokens, offset + width + pad, gen=gen, dtype=dtype)
    return buf[:, offset:offset + width]


# -- RMSNorm --------------------------------------------------------------------------------------

def check_rms_norm(ops, dtype, num_tokens, hidden, offset=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("rms", dtype, num_tokens, hidden, offset))
    x = rows_view(num_tokens, hidden, dtype, gen, offset)
    weight = randn(hidden, gen=gen, dtype=dtype)
    x_before = x.clone()
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=DEVICE)
    assert ops.rms_norm(x, weight, EPS, out=out) is out
    assert torch.equal(x, x_before)
    rows_within(out, rms_norm64(x, weight), ref.rms_norm(x, weight, EPS), "rms_norm")
    fresh = ops.rms_norm(x, weight, EPS)  # out allocated by the launcher
    assert torch.equal(fresh, out)


def check_fused_add_rms_norm(ops, dtype, num_tokens, hidden, offset=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("add_rms", dtype, num_tokens, hidden, offset))
    x = rows_view(num_tokens, hidden, dtype, gen, offset)
    residual = rows_view(num_tokens, hidden, dtype, gen, offset, pad=16)
    weight = randn(hidden, gen=gen, dtype=dtype)
    x_in, residual_in = x.clone(), residual.clone()
    base_x, base_residual = ref.fused_add_rms_norm(x_in.clone(), residual_in.clone(), weight, EPS)
    x_out, residual_out = ops.fused_add_rms_norm(x, residual, weight, EPS)
    assert x_out is x and residual_out is residual
    # The residual sum is rounded exactly as torch's `residual + x` in the dtype.
    assert torch.equal(residual, base_residual)
    rows_within(x, rms_norm64(residual_in.double() + x_in.double(), weight), base_x,
                "fused_add_rms_norm")


# -- per-head RMSNorm (Qwen3's q_norm / k_norm) ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])  # 80: rms_norm over copies
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8), (64, 8)])  # (64, 8) at 256: a loop
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("offset", [0, 8, 1])  # 1: rows not 16-byte aligned, rms_norm over copies
def test_head_rms_norm_is_rms_norm_on_the_head_rows(ops, dtype, head_dim, heads, kv_heads,
                                                    num_tokens, offset):
    """In place on q and k as views of one fused qkv output (after `offset` leading columns):
    bit for bit ops.rms_norm on the heads' rows (its sum order, so the same rounding; rms_norm
    itself is checked against float64 above), v and the leading columns untouched."""
    gen = torch.Generator(device=DEVICE).manual_seed(
        seed_of("head_norm", dtype, num_tokens, heads, head_dim, offset))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    buf = randn(num_tokens, offset + q_size + 2 * kv_size, gen=gen, dtype=dtype) * 3
    q, k, _ = buf[:, offset:].split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    q_weight = (torch.rand(head_dim, generator=gen, device=DEVICE) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, generator=gen, device=DEVICE) + 0.5).to(dtype)
    want_q = ops.rms_norm(q.reshape(-1, head_dim), q_weight, EPS).view(q.shape)
    want_k = ops.rms_norm(k.reshape(-1, head_dim), k_weight, EPS).view(k.shape)
    before = buf.clone()
    ops.head_rms_norm(q, k, q_weight, k_weight, EPS)
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[:, offset:offset + q_size + kv_size] = False
    assert torch.equal(buf[untouched], before[untouched]), "wrote outside q and k"
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_head_rms_norm_captures_in_a_graph(ops):
    """The one launch replays from a CUDA graph on new values in place."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("head_norm_graph"))
    buf = randn(5, 48 * 128, gen=gen, dtype=torch.bfloat16)
    q, k, _ = buf.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(5, 32, 128), k.view(5, 8, 128)
    w = (torch.rand(128, generator=gen, device=DEVICE) + 0.5).to(torch.bfloat16)
    fresh = randn(5, 48 * 128, gen=gen, dtype=torch.bfloat16)
    graph = capture(lambda: ops.head_rms_norm(q, k, w, w, EPS))
    buf.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    want = fresh[:, :32 * 128].reshape(-1, 128)
    assert torch.equal(q.reshape(-1, 128), ops.rms_norm(want, w, EPS))


# -- RoPE -----------------------------------------------------------------------------------------

def check_rotary(ops, dtype, num_tokens, heads, kv_heads, head_dim, offset=0, rotary_dim=None,
                 interleaved=False):
    """q/k as the model makes them: views of one fused qkv output (here with `offset` extra
    leading columns); v and the extra columns must come out untouched. rotary_dim: the tables'
    width (partial rotary), head_dim when None."""
    rotary_dim = rotary_dim or head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(
        seed_of("rope", dtype, num_tokens, heads, head_dim, offset, rotary_dim, interleaved))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    buf = randn(num_tokens, offset + q_size + 2 * kv_size, gen=gen, dtype=dtype)
    q, k, v = buf[:, offset:].split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=DEVICE)
    cos_table, sin_table = rope_tables(rotary_dim)
    before = buf.clone()
    q_in, k_in = q.clone(), k.clone()
    base_q, base_k = q_in.clone(), k_in.clone()
    ref.rotary_embedding(positions, base_q, base_k, cos_table, sin_table, interleaved)
    ops.rotary_embedding(positions, q, k, cos_table, sin_table, interleaved)
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[:, offset:offset + q_size + kv_size] = False
    assert torch.equal(buf[untouched], before[untouched]), "wrote outside q and k"
    rotated_within(q, q_in, base_q, positions, cos_table, sin_table, interleaved, "rotary q")
    rotated_within(k, k_in, base_k, positions, cos_table, sin_table, interleaved, "rotary k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8)])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_embedding(ops, dtype, head_dim, heads, kv_heads, num_tokens):
    check_rotary(ops, dtype, num_tokens, heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,offset", [(64, 1), (128, 1), (72, 0), (16, 0)])
def test_rotary_embedding_other_layouts(ops, dtype, head_dim, offset):
    """Misaligned q/k rows, or a half head_dim that is not a whole vector (72 / 2 = 36); and the
    smallest vector case (head_dim 16: one vector per half)."""
    check_rotary(ops, dtype, 33, 9, 3, head_dim, offset)


# (head_dim, rotary_dim, interleaved): partial rotary (GLM: half of 128), interleaved pairs, both
ROPE_VARIANTS = [(128, 64, False), (128, 32, False), (64, 32, False), (128, 128, True),
                 (64, 64, True), (128, 64, True), (128, 32, True), (64, 32, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,interleaved", ROPE_VARIANTS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 2)])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_embedding_partial_and_interleaved(ops, dtype, head_dim, rotary_dim, interleaved,
                                                  heads, kv_heads, num_tokens):
    check_rotary(ops, dtype, num_tokens, heads, kv_heads, head_dim, rotary_dim=rotary_dim,
                 interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,interleaved,offset",
                         [(128, 64, True, 1), (128, 32, False, 1), (64, 32, True, 1),
                          (64, 24, True, 0), (64, 24, False, 0), (72, 40, True, 0),
                          (72, 32, True, 0), (16, 16, True, 0), (16, 2, True, 0)])
def test_rotary_embedding_partial_and_interleaved_other_layouts(ops, dtype, head_dim, rotary_dim,
                                                                interleaved, offset):
    """The scalar path for both variants: misaligned rows, or half a rotated span that is not
    whole vectors (24 / 2 = 12, 40 / 2 = 20, 2 / 2 = 1); and vectors whose head_dim is not
    (72 with 32 rotated; 16, one vector pair)."""
    check_rotary(ops, dtype, 33, 9, 3, head_dim, offset, rotary_dim, interleaved)


def test_rotary_embedding_refuses_tables_wider_than_a_head_or_odd(ops):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q = randn(4, 8, 64, gen=gen, dtype=torch.bfloat16)
    k = randn(4, 2, 64, gen=gen, dtype=torch.bfloat16)
    positions = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for width in (128, 33, 0):
        table = torch.zeros(16, width, device=DEVICE)
        with pytest.raises(ValueError, match="rotary_dim"):
            ops.rotary_embedding(positions, q, k, table, table)


def test_rotary_embedding_leaves_out_of_range_positions(ops):
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    q = randn(4, 8, 64, gen=gen, dtype=torch.bfloat16)
    k = randn(4, 2, 64, gen=gen, dtype=torch.bfloat16)
    q_in, k_in = q.clone(), k.clone()
    cos_table, sin_table = rope_tables(64)
    positions = torch.tensor([5, -1, MAX_POS, 17], device=DEVICE)
    ops.rotary_embedding(positions, q, k, cos_table, sin_table)
    assert torch.equal(q[1:3], q_in[1:3]) and torch.equal(k[1:3], k_in[1:3])
    assert not torch.equal(q[0], q_in[0]) and not torch.equal(k[3], k_in[3])


def qkv_views(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """q [T, heads, hd], k and v [T, kv_heads, hd]: strided views of a fused qkv [T, *] buffer,
    as the model's projection leaves them."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim),
            v.view(-1, kv_heads, head_dim))


def check_rotary_and_cache(ops, dtype, num_tokens, heads, kv_heads, head_dim, slot_dtype,
                           block_size=16, rotary_dim=None, interleaved=False):
    """The fused launch against rotary_embedding then reshape_and_cache on copies of the same
    inputs: q, k (in place), the whole qkv buffer and both whole caches bit for bit. Slots are
    distinct random ones of a cache prefilled with noise; every fifth token's slot is -1 (writes
    nothing) and one position is out of range (q and k left unrotated, k still cached)."""
    from pagedserve_kernels import cache_ops

    rotary_dim = rotary_dim or head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of(
        "rope_cache", dtype, num_tokens, heads, head_dim, slot_dtype, rotary_dim, interleaved))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    num_blocks = num_tokens // block_size + 3
    qkv = randn(num_tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype)
    k_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    v_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[::5] = -1
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=DEVICE)
    positions[num_tokens // 2] = MAX_POS
    cos_table, sin_table = rope_tables(rotary_dim)

    def views(buf):
        return qkv_views(buf, heads, kv_heads, head_dim)

    expect = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = views(expect[0])
    ops.rotary_embedding(positions, q, k, cos_table, sin_table, interleaved)
    cache_ops.reshape_and_cache(k, v, expect[1], expect[2], slots.to(slot_dtype))
    q, k, v = views(qkv)
    ops.rotary_embedding_and_cache(positions, q, k, v, cos_table, sin_table, k_cache, v_cache,
                                   slots.to(slot_dtype), interleaved)
    for name, got, want in zip(("qkv", "k_cache", "v_cache"), (qkv, k_cache, v_cache), expect):
        assert torch.equal(got, want), f"{name} differs from the two launches"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8), (2, 4)])  # (2, 4): v > rope units
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_rotary_embedding_and_cache(ops, dtype, head_dim, heads, kv_heads, num_tokens, slot_dtype):
    check_rotary_and_cache(ops, dtype, num_tokens, heads, kv_heads, head_dim, slot_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_and_cache_two_launch_fallback(ops, dtype):
    """head_dim 72: rows of whole 16-byte vectors for the cache write, but a half of 36 elements
    is not whole vectors, so the launcher takes the two kernels; same contract."""
    check_rotary_and_cache(ops, dtype, 33, 9, 3, 72, torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,interleaved", ROPE_VARIANTS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 2), (2, 4)])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_rotary_embedding_and_cache_partial_and_interleaved(ops, dtype, head_dim, rotary_dim,
                                                            interleaved, heads, kv_heads,
                                                            num_tokens):
    """The fused launch's own paths for the variants: pairs of neighbours, and k's unrotated
    tail copied to the cache by units of their own ((2, 4): more cache vectors than RoPE units)."""
    check_rotary_and_cache(ops, dtype, num_tokens, heads, kv_heads, head_dim, torch.int64,
                           rotary_dim=rotary_dim, interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,interleaved",
                         [(72, 32, True), (72, 32, False), (72, 40, True), (64, 24, False)])
def test_rotary_embedding_and_cache_partial_other_layouts(ops, dtype, head_dim, rotary_dim,
                                                          interleaved):
    """head_dim 72 with 32 rotated: the fused launch, a tail of five vectors; 40 or 24 rotated:
    half the span is not whole vectors, so the two launches."""
    check_rotary_and_cache(ops, dtype, 33, 9, 3, head_dim, torch.int32, rotary_dim=rotary_dim,
                           interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,interleaved", [(128, 128, False)] + ROPE_VARIANTS)
def test_rotary_embedding_and_cache_writes_what_the_reference_does(ops, dtype, head_dim,
                                                                   rotary_dim, interleaved):
    """Against the torch twins (RoPE in the dtype, as transformers): q and the cached k within
    the rows_within bound of float64 on the rotated span, their tails as they came, v cached
    exactly; slots -1 leave their cache rows alone."""
    gen = torch.Generator(device=DEVICE).manual_seed(
        seed_of("rope_cache_ref", dtype, head_dim, rotary_dim, interleaved))
    num_tokens, heads, kv_heads, block_size = 40, 32, 8, 16
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    q_in, k_in = q.clone(), k.clone()
    k_cache = torch.zeros(8, kv_heads, block_size, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(8 * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[3] = -1
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=DEVICE)
    cos_table, sin_table = rope_tables(rotary_dim)
    base_q, base_k = q_in.clone(), k_in.clone()
    ref.rotary_embedding(positions, base_q, base_k, cos_table, sin_table, interleaved)
    ops.rotary_embedding_and_cache(positions, q, k, v, cos_table, sin_table, k_cache, v_cache,
                                   slots, interleaved)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    cached_k, cached_v = k_cache[blocks, :, offsets], v_cache[blocks, :, offsets]
    rotated_within(q, q_in, base_q, positions, cos_table, sin_table, interleaved, "fused rotary q")
    rotated_within(cached_k, k_in[keep], base_k[keep], positions[keep], cos_table, sin_table,
                   interleaved, "cached k")
    assert torch.equal(cached_v, v[keep]) and torch.equal(k[keep], cached_k)
    written = torch.zeros(8 * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[keep]] = True
    untouched = (~written).view(8, 1, block_size).expand(8, kv_heads, block_size)
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


# -- SiLU-and-mul ---------------------------------------------------------------------------------

def check_silu_and_mul(ops, dtype, num_tokens, d, offset=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("silu", dtype, num_tokens, d, offset))
    x = rows_view(num_tokens, 2 * d, dtype, gen, offset)
    x_before = x.clone()
    out = torch.full((num_tokens, d), float("nan"), dtype=dtype, device=DEVICE)
    assert ops.silu_and_mul(x, out=out) is out
    assert torch.equal(x, x_before)
    rows_within(out, silu_and_mul64(x), ref.silu_and_mul(x), "silu_and_mul")
    assert torch.equal(ops.silu_and_mul(x), out)


# -- the row-wise ops: each at two model widths (hidden, or SiLU-and-mul's d), every token count;
# then rows 2 bytes off a 16-byte boundary, or widths that are not whole 16-byte vectors (8195 >
# 1024 threads: several elements per thread)

ROW_OPS = {"rms_norm": check_rms_norm, "fused_add_rms_norm": check_fused_add_rms_norm,
           "silu_and_mul": check_silu_and_mul}
_NORM_WIDTHS, _NORM_SCALAR = [576, 4096], [(576, 1), (4096, 1), (100, 0), (8195, 0)]
ROW_WIDTHS = {"rms_norm": _NORM_WIDTHS, "fused_add_rms_norm": _NORM_WIDTHS,
              "silu_and_mul": [1536, 14336]}
ROW_SCALAR_CASES = {"rms_norm": _NORM_SCALAR, "fused_add_rms_norm": _NORM_SCALAR,
                    "silu_and_mul": [(1536, 1), (1003, 0)]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("op,width", [(op, w) for op, ws in ROW_WIDTHS.items() for w in ws])
def test_row_op(ops, op, width, dtype, num_tokens):
    ROW_OPS[op](ops, dtype, num_tokens, width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,width,offset",
                         [(op, *case) for op, cases in ROW_SCALAR_CASES.items() for case in cases])
def test_row_op_scalar_path(ops, op, width, offset, dtype):
    ROW_OPS[op](ops, dtype, 37, width, offset)


# -- CUDA graphs ----------------------------------------------------------------------------------

def test_cuda_graph_capture_and_replay(ops):
    """The four ops captured once (Llama-3-8B shapes, 64 tokens; RoPE twice, the second partial
    and interleaved as GLM's), replayed on new inputs written in place: bit-identical to the same
    launches run eagerly."""
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    num_tokens, hidden, inter, heads, kv_heads, head_dim = 64, 4096, 14336, 32, 8, 128
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    dtype = torch.bfloat16
    w1, w2 = randn(hidden, gen=gen, dtype=dtype), randn(hidden, gen=gen, dtype=dtype)
    cos_table, sin_table = rope_tables(head_dim)
    glm_cos, glm_sin = rope_tables(head_dim // 2)

    def buffers():
        return {
            "x": torch.empty(num_tokens, hidden, dtype=dtype, device=DEVICE),
            "residual": torch.empty(num_tokens, hidden, dtype=dtype, device=DEVICE),
            "qkv": torch.empty(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=DEVICE),
            "gate_up": torch.empty(num_tokens, 2 * inter, dtype=dtype, device=DEVICE),
            "positions": torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
            "normed": torch.empty(num_tokens, hidden, dtype=dtype, device=DEVICE),
            "act": torch.empty(num_tokens, inter, dtype=dtype, device=DEVICE),
        }

    def fill(b):
        for name in ("x", "residual", "qkv", "gate_up"):
            b[name].copy_(torch.randn(b[name].shape, generator=gen, device=DEVICE))
        b["positions"].copy_(torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=DEVICE))
        b["normed"].fill_(float("nan"))
        b["act"].fill_(float("nan"))

    def step(b):
        q, k, _ = b["qkv"].split([q_size, kv_size, kv_size], dim=-1)
        ops.rms_norm(b["x"], w1, EPS, out=b["normed"])
        ops.fused_add_rms_norm(b["x"], b["residual"], w2, EPS)
        q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
        ops.rotary_embedding(b["positions"], q, k, cos_table, sin_table)
        ops.rotary_embedding(b["positions"], q, k, glm_cos, glm_sin, interleaved=True)
        ops.silu_and_mul(b["gate_up"], out=b["act"])

    static = buffers()
    fill(static)
    graph = capture(lambda: step(static))
    for _ in range(2):
        fill(static)
        eager = {name: t.clone() for name, t in static.items()}
        step(eager)
        graph.replay()
        torch.cuda.synchronize()
        for name in ("normed", "x", "residual", "qkv", "act"):
            assert torch.equal(static[name], eager[name]), f"{name} differs after replay"


# -- the grammar token mask ----------------------------------------------------------------------

def _mask_case(vocab: int, layout: str, gen: torch.Generator):
    """(wide [9, vocab + 3] float32, whose first vocab columns are the logits: a row stride past
    the vocabulary; bitmask [m, words] int32 with a row stride past its words; indices or None):
    random bits, a row allowing every token and one allowing none; "padded" indices name rows
    outside the logits too."""
    n, words = 9, -(-vocab // 32)
    wide_logits = randn(n, vocab + 3, gen=gen)
    indices = {"identity": None, "indices": [7, 0, 3, 8], "padded": [2, -1, 5, 9, -4, 0]}[layout]
    m = n if indices is None else len(indices)
    wide = torch.randint(-2**31, 2**31, (m, words + 2), generator=gen, device=DEVICE,
                         dtype=torch.int64).to(torch.int32)
    bitmask = wide[:, :words]
    bitmask[0] = -1
    bitmask[1] = 0
    if indices is not None:
        indices = torch.tensor(indices, dtype=torch.int64, device=DEVICE)
    return wide_logits, bitmask, indices


@pytest.mark.parametrize("vocab", [32, 1000, 49152, 151_937])
@pytest.mark.parametrize("layout", ["identity", "indices", "padded"])
def test_apply_token_bitmask_matches_the_twin_bit_for_bit(ops, vocab, layout):
    """-inf exactly where the twin puts it, every other logit (the columns past the vocabulary,
    rows no index names, padding rows' targets) untouched."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("mask", vocab, layout))
    wide_logits, bitmask, indices = _mask_case(vocab, layout, gen)
    want_base, got_base = wide_logits.clone(), wide_logits.clone()  # [9, vocab + 3]
    ref.apply_token_bitmask(want_base[:, :vocab], bitmask, indices)
    ops.apply_token_bitmask(got_base[:, :vocab], bitmask, indices)
    torch.cuda.synchronize()
    assert torch.equal(got_base, want_base)
    assert torch.isinf(got_base).any() and torch.isfinite(got_base[:, vocab:]).all()


def test_apply_token_bitmask_replays_in_a_cuda_graph_with_new_bits(ops):
    """Captured once over static buffers, replayed with new bits, indices and logits each time,
    as the masked decode graphs replay it."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("mask-graph"))
    wide_logits, bitmask, indices = _mask_case(49152, "padded", gen)
    static = [t.clone() for t in (wide_logits, bitmask, indices)]
    ops.apply_token_bitmask(static[0][:, :49152], static[1], static[2])  # loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.apply_token_bitmask(static[0][:, :49152], static[1], static[2])
    for layout in ("padded", "indices", "padded"):
        wide_logits, bitmask, indices = _mask_case(49152, layout, gen)
        indices = torch.cat([indices, torch.full((6 - len(indices),), -1, device=DEVICE)])
        static[0].copy_(wide_logits)
        static[1][:len(bitmask)].copy_(bitmask)
        static[2].copy_(indices)
        want = wide_logits.clone()
        ref.apply_token_bitmask(want[:, :49152], bitmask, indices[:len(bitmask)])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static[0], want)


# -- sampling's race -------------------------------------------------------------------------------

def _race_case(n: int, vocab: int, gen: torch.Generator):
    """(wide [n, vocab + 5] float32 whose first vocab columns are the scores: a row stride past
    the vocabulary, with -inf (a grammar's or a filter's drops), a whole -inf row, a NaN, NaNs
    and +inf in other threads' and warps' columns, +inf ties; row seeds [n] int64, 63-bit as
    position_seed makes them)."""
    wide = randn(n, vocab + 5, gen=gen) * 3
    scores = wide[:, :vocab]
    drop = torch.rand(n, vocab, generator=gen, device=DEVICE) < 0.4
    scores.masked_fill_(drop, float("-inf"))
    if n > 2:
        scores[1] = float("-inf")  # nothing allowed: torch.argmax's index 0
        scores[2, vocab // 2] = float("nan")
    if n > 5 and vocab > 700:  # across threads and warps: the first NaN, else the first +inf
        scores[4, 100] = scores[4, 600] = float("nan")
        scores[4, 650] = float("inf")
        scores[5, 37] = scores[5, 700] = float("inf")
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=gen, device=DEVICE)  # 63-bit seeds
    return wide, seeds


@pytest.mark.parametrize("n,vocab", [(1, 32), (7, 1000), (64, 49152), (256, 128_256),
                                     (3, 151_937), (6, 513)])
def test_gumbel_argmax_draws_the_torch_ops_token_bit_for_bit(ops, n, vocab):
    """The kernel against executor_svc.sampler's torch ops on the same device: the same ids,
    and the scores it reads left as they were."""
    from executor_svc.sampler import race_argmax

    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("race", n, vocab))
    for _ in range(3):
        wide, seeds = _race_case(n, vocab, gen)
        before = wide.clone()
        got = ops.gumbel_argmax(wide[:, :vocab], seeds)
        want = race_argmax(wide[:, :vocab].clone(), seeds, fused=False)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (got, want)
        assert torch.equal(wide.nan_to_num(), before.nan_to_num())


def test_gumbel_argmax_replays_in_a_cuda_graph(ops):
    """Captured over static buffers as the decode graphs' sampling captures it; replayed with
    new scores and seeds."""
    from executor_svc.sampler import race_argmax

    gen = torch.Generator(device=DEVICE).manual_seed(seed_of("race-graph"))
    wide, seeds = _race_case(16, 49152, gen)
    static_scores, static_seeds = wide[:, :49152].contiguous(), seeds.clone()
    out = {}
    graph = capture(lambda: out.__setitem__("ids", ops.gumbel_argmax(static_scores,
                                                                     static_seeds)))
    for _ in range(3):
        wide, seeds = _race_case(16, 49152, gen)
        static_scores.copy_(wide[:, :49152])
        static_seeds.copy_(seeds)
        graph.replay()
        want = race_argmax(wide[:, :49152].clone(), seeds, fused=False)
        torch.cuda.synchronize()
        assert torch.equal(out["ids"], want)
