"""The CuPy kernels against their torch reference twins on the GPU.

Attention: per sequence, ||kernel - ref64|| / ||ref64|| (ref64: the reference twin's _attend in
float64) must stay within 2x the same error of torch doing the computation in the kernel's dtype
(SDPA in bf16/fp16; with a soft-cap, matmul, tanh and softmax in that dtype), plus a 1e-3 floor;
outputs are poisoned with NaN first. Copies: bit-exact, untouched pages unchanged. Fresh random
inputs per case.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import reference as ref
from tests.gpu import gpu_ready


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]

DTYPES = [torch.bfloat16, torch.float16]
FLOOR = 1e-3


@pytest.fixture(scope="module")
def kern():
    from pagedserve_kernels import _compile, attention, cache_ops

    _compile.warmup()
    return attention, cache_ops


def paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen, spare=5, width_extra=1):
    """Random K/V pages, shuffled; returns k_cache, v_cache, block_tables (int32, CUDA)."""
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    width = max(pages + [1]) + width_extra
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, device="cuda",
                           dtype=torch.int32)  # garbage past each sequence's pages
    used = 0
    for i, p in enumerate(pages):
        tables[i, :p] = perm[used : used + p]
        used += p
    return k_cache, v_cache, tables


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rel_err(x: torch.Tensor, ref64: torch.Tensor) -> float:
    return ((x.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def torch_in_dtype(q, k, v, scale, window=None, cap=None):
    """Same attention by torch in q's dtype: q [q_len, H, D], k/v [ctx, KVH, D]; SDPA, or with a
    soft-cap matmul, tanh and softmax (SDPA has no cap)."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
    mask = k_pos <= q_pos  # [q_len, ctx]
    if window is not None:
        mask &= k_pos > q_pos - window
    qt = q.transpose(0, 1)  # [H, q_len, D]
    kt = k.repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
    vt = v.repeat_interleave(group, 1).transpose(0, 1)
    if cap is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    else:
        scores = torch.tanh(torch.matmul(qt, kt.transpose(1, 2)) * scale / cap) * cap
        out = torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1), vt)
    return out.transpose(0, 1)


def check_attention(out, q, k_cache, v_cache, tables, cu, seq_lens, scale, window=None, cap=None):
    """Per sequence: the float64 result (the reference twin's _attend in float64 on the GPU)
    against the kernel and against torch in the kernel's dtype."""
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    starts, lens = cu.tolist(), seq_lens.tolist()
    for i, n in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        k = ref.gather_kv(k_cache, tables[i], n)
        v = ref.gather_kv(v_cache, tables[i], n)
        ref64 = ref._attend(q[a:b].double(), k.double(), v.double(), scale, window, cap)
        base = rel_err(torch_in_dtype(q[a:b], k, v, scale, window, cap), ref64)
        err = rel_err(out[a:b], ref64)
        assert err <= 2 * base + FLOOR, (f"seq {i} (q_len {b - a}, ctx {n}, window {window}, cap "
                                         f"{cap}): {err:.2e} vs torch {base:.2e}")


def test_kernels_match_the_reference_twins_on_cpu(kern):
    """Small case through pagedserve_kernels.reference itself (on CPU, float64): prefill and
    decode."""
    attention, _ = kern
    gen = torch.Generator(device="cuda").manual_seed(21)
    seq_lens, q_lens = [70, 33, 200], [70, 5, 1]
    k_cache, v_cache, tables = paged_cache(seq_lens, 2, 64, 16, torch.bfloat16, gen)
    q = torch.randn(sum(q_lens), 8, 64, generator=gen, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, 70, 75, 76], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    cpu = [t.cpu() for t in (q, k_cache, v_cache, tables, cu, lens)]
    ref64 = ref.paged_prefill_attention(cpu[0].double(), cpu[1].double(), cpu[2].double(), *cpu[3:], 0.125)
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    assert rel_err(out.cpu(), ref64) < 1e-2
    dec_ref = ref.paged_decode_attention(cpu[0][:3].double(), cpu[1].double(), cpu[2].double(),
                                         cpu[3], cpu[5], 0.125)
    dec = attention.paged_decode_attention(q[:3], k_cache, v_cache, tables, lens, 0.125)
    assert rel_err(dec.cpu(), dec_ref) < 1e-2


PREFILL_CASES = {
    # name: (seq_lens, q_lens)
    "ragged_full": ([1, 7, 128, 129, 300, 515], [1, 7, 128, 129, 300, 515]),
    # seq 300's 290 new rows: a 128-row tile whose first 64 rows end before its last key tile
    # and whose last 64 reach it (the pipelined kernel's warpgroups then skip different tiles)
    "chunked": ([200, 1000, 77, 640, 300], [64, 129, 77, 1, 290]),
    "long": ([2048], [2048]),
}


# The default prefill kernels (on Hopper the pipelined kernel at hd128, the two-warpgroup wgmma
# kernel at hd64), then the mma.sync fallback kernels.
PREFILL_VARIANTS = ["default", "mma_sync"]
# (variant, head_dim) of the prefill tests: both at both head dims, and the two-warpgroup wgmma
# kernel ("wg", Hopper) on every case the default runs at hd128.
PREFILL_RUNS = [(v, hd) for v in PREFILL_VARIANTS for hd in (64, 128)] + [("wg", 128)]

# name: (sliding_window, soft_cap, q's scale): windows of one position, inside a page, of one or
# just past a page or tile (16/32-key pages, 64/128-key tiles, 64-key decode stages), across many
# tiles, and past every context (causal only); soft-caps with scores where the cap bites (q
# scaled up for 50), alone and beside a window.
FEATURES = {
    "w1": (1, None, 1.0), "w5": (5, None, 1.0), "w16": (16, None, 1.0), "w17": (17, None, 1.0),
    "w100": (100, None, 1.0), "w129": (129, None, 1.0), "w700": (700, None, 1.0),
    "w20000": (20000, None, 1.0), "cap5": (None, 5.0, 1.0), "cap50": (None, 50.0, 4.0),
    "w33_cap5": (33, 5.0, 1.0), "w100_cap50": (100, 50.0, 4.0),
}
NO_FEATURES = (None, None, 1.0)  # full causal attention, no cap, q as drawn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("variant,head_dim", PREFILL_RUNS)
def test_prefill_matches_reference(kern, variant, dtype, head_dim, heads, kv_heads, block_size,
                                   case):
    _check_packed(kern, False, dtype, head_dim, heads, kv_heads, block_size, case, NO_FEATURES,
                  variant=variant)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("features", ["none", "w33_cap5"])
def test_prefill_candidate_wg1_hd64(kern, heads, kv_heads, block_size, case, features):
    """The benchmark's comparison variant (wgmma hd64 at 1 CTA/SM), and block size 8."""
    _check_packed(kern, False, torch.bfloat16, 64, heads, kv_heads, block_size, case,
                  FEATURES.get(features, NO_FEATURES), variant="wg1")


# A full prefill of a few tiles, chunks over longer contexts (the last one's first tiles wholly
# before a small window), one-token rows.
WINDOW_PREFILL_CASE = ([7, 129, 300, 1000, 640, 77, 2048], [7, 129, 300, 129, 1, 77, 256])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,block_size", [(8, 2, 16), (4, 4, 32)])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("variant,head_dim", PREFILL_RUNS)
def test_prefill_window_and_soft_cap(kern, variant, dtype, head_dim, heads, kv_heads, block_size,
                                     features):
    _check_packed(kern, False, dtype, head_dim, heads, kv_heads, block_size, "window",
                  FEATURES[features], variant=variant)


def _check_packed(kern, few_query, dtype, head_dim, heads, kv_heads, block_size, case, features,
                  **options):
    """The prefill launcher on PREFILL_CASES[case], or with few_query the few-query one on
    FEW_QUERY_CASES[case] (q a strided view of a packed qkv, block tables three columns wider
    than their pages), against check_attention; options go to the launcher."""
    attention, _ = kern
    window, cap, q_scale = features
    if few_query:
        seq_lens, q_lens = WINDOW_FEW_QUERY_CASE if case == "window" else FEW_QUERY_CASES[case]
        seed = seed_of("few", case, dtype, head_dim, heads, block_size, features)
    else:
        seq_lens, q_lens = WINDOW_PREFILL_CASE if case == "window" else PREFILL_CASES[case]
        seed = seed_of(case, dtype, head_dim, heads, block_size, features)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen,
                                           width_extra=3 if few_query else 1)
    width = heads + 2 * kv_heads if few_query else heads
    q = torch.randn(sum(q_lens), width, head_dim, generator=gen, device="cuda")
    q = (q * q_scale).to(dtype)[:, :heads]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    launch = attention.paged_few_query_attention if few_query else attention.paged_prefill_attention
    launch(q, k_cache, v_cache, tables, cu, lens, scale, out=out, sliding_window=window,
           soft_cap=cap, **options)
    check_attention(out, q, k_cache, v_cache, tables, cu, lens, scale, window, cap)


def test_prefill_strided_q_and_empty_sequences(kern):
    """q as a view into a fused qkv buffer; a sequence with no new tokens in the batch."""
    attention, _ = kern
    gen = torch.Generator(device="cuda").manual_seed(7)
    heads, kv_heads, head_dim = 8, 2, 128
    seq_lens, q_lens = [300, 50, 90], [300, 0, 33]
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, 16, torch.bfloat16, gen)
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim, generator=gen, device="cuda")
    q = qkv.to(torch.bfloat16)[:, :heads]
    cu = torch.tensor([0, 300, 300, 333], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1)
    check_attention(out, q, k_cache, v_cache, tables, cu, lens, 0.1)


FEW_QUERY_CASES = {
    # name: (seq_lens, q_lens): tiles of 16 / group tokens, ragged at both ends of a seq
    "cached_prefix": ([2016], [16]),
    "mixed": ([300, 1, 57, 2016, 129, 5000], [1, 1, 5, 16, 17, 3]),
    "short_contexts": ([1, 2, 3, 4, 5, 9, 16, 17, 33], [1, 2, 3, 4, 5, 9, 16, 17, 33]),
    # several tiles a seq at every group (tiles of 64 / group tokens)
    "long_chunks": ([3000, 700, 90], [100, 70, 65]),
    # SmallStepGraphs' padding: seqs with no query tokens, with or without a context
    "padded": ([2016, 0, 40, 0, 0], [16, 0, 0, 0, 0]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (16, 2), (16, 1)])  # 64 to 4 tokens a CTA
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(FEW_QUERY_CASES))
@pytest.mark.parametrize("key_split", [False, True])  # the default kernels, then the candidates
def test_few_query_attention_matches_reference(kern, dtype, head_dim, heads, kv_heads, block_size,
                                              case, key_split):
    """paged_few_query_attention against float64 with paged_prefill_attention's semantics, q as a
    strided view (as the model passes it), outputs poisoned with NaN."""
    _check_packed(kern, True, dtype, head_dim, heads, kv_heads, block_size, case, NO_FEATURES,
                  key_split=key_split)


# Entries of one token to several tiles a seq, at both ends of a page; a padded seq.
WINDOW_FEW_QUERY_CASE = ([300, 1, 57, 2016, 129, 5000, 3000, 90, 0],
                         [1, 1, 5, 16, 17, 3, 100, 65, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(8, 8, 16), (32, 8, 32), (16, 1, 16)])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("key_split", [False, True])
def test_few_query_window_and_soft_cap(kern, dtype, head_dim, heads, kv_heads, block_size,
                                       features, key_split):
    """64, 16 and 4 tokens a CTA, each row masked at its own window."""
    _check_packed(kern, True, dtype, head_dim, heads, kv_heads, block_size, "window",
                  FEATURES[features], key_split=key_split)




DECODE_CASES = {
    # name: context lengths
    "few_long": [16384, 5000, 1],
    "mixed": [1, 15, 16, 17, 31, 32, 33, 1000, 4097, 257],
    "many_short": "256x1..600",
}


def decode_lens(case):
    spec = DECODE_CASES[case]
    if isinstance(spec, str):
        return torch.randint(1, 600, (256,), generator=torch.Generator().manual_seed(3)).tolist()
    return spec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference(kern, dtype, head_dim, heads, kv_heads, block_size, case):
    _check_decode(kern, dtype, head_dim, heads, kv_heads, block_size, decode_lens(case), {},
                  seed=seed_of(case, dtype, head_dim, heads, block_size))


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("ctas_per_sm", [None, 4, 24])
@pytest.mark.parametrize("variant", ["default", "s2"])
@pytest.mark.parametrize("features", ["none", "w100_cap50"])
def test_decode_candidate_kernel_and_split_policies(kern, case, ctas_per_sm, variant, features):
    """The 2-stage hd128 candidate the benchmark times, and other split counts (few seqs or many
    alike), stay correct."""
    _check_decode(kern, torch.bfloat16, 128, 32, 8, 16, decode_lens(case),
                  dict(variant=variant, ctas_per_sm=ctas_per_sm),
                  FEATURES.get(features, (None, None, 1.0)),
                  seed=seed_of("cand", case, ctas_per_sm, variant, features))


# Contexts of one token to many pages, at page edges, and long ones split over many CTAs.
WINDOW_DECODE_LENS = [1, 15, 16, 17, 31, 32, 33, 1000, 4097, 257, 16384, 5000, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(8, 8, 16), (16, 2, 32)])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("policy", ["default", "short_splits"])
def test_decode_window_and_soft_cap(kern, dtype, head_dim, heads, kv_heads, block_size, features,
                                    policy):
    """Splits laid over the window's pages: the default plan, and one of many short splits (a
    window's pages over several CTAs, merged by the combine)."""
    options = {} if policy == "default" else dict(ctas_per_sm=24, max_pages=8)
    _check_decode(kern, dtype, head_dim, heads, kv_heads, block_size, WINDOW_DECODE_LENS, options,
                  FEATURES[features],
                  seed=seed_of("dwin", dtype, head_dim, heads, block_size, features, policy))


def _check_decode(kern, dtype, head_dim, heads, kv_heads, block_size, seq_lens, options,
                  features=(None, None, 1.0), seed=0):
    attention, _ = kern
    window, cap, q_scale = features
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen,
                                           width_extra=3)
    q = (torch.randn(len(seq_lens), heads, head_dim, generator=gen, device="cuda") * q_scale).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out,
                                     sliding_window=window, soft_cap=cap, **options)
    empty = lens == 0  # a zero row, as documented
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    keep = (~empty).nonzero().flatten()
    cu = torch.arange(len(keep) + 1, dtype=torch.int32, device="cuda")
    check_attention(out[keep], q[keep], k_cache, v_cache, tables[keep], cu, lens[keep],
                    head_dim**-0.5, window, cap)


def test_decode_zero_length_rows_are_zero(kern):
    attention, _ = kern
    gen = torch.Generator(device="cuda").manual_seed(11)
    for width_extra in (1, 400):  # one split, and a wide table that forces several
        k_cache, v_cache, tables = paged_cache([40, 0, 9], 2, 128, 16, torch.bfloat16, gen,
                                               width_extra=width_extra)
        q = torch.randn(3, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
        lens = torch.tensor([40, 0, 9], dtype=torch.int32, device="cuda")
        out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.08)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,kv_heads,block_size", [(128, 8, 16), (64, 1, 32), (128, 2, 32)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_bit_exact(kern, dtype, head_dim, kv_heads, block_size, slot_dtype):
    _, cache_ops = kern
    gen = torch.Generator(device="cuda").manual_seed(head_dim * kv_heads + block_size)
    num_blocks, num_tokens = 64, 300
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    # key/value as strided views of a fused projection output, as the executor produces them
    fused = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    key, value = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(key, value, expect_k, expect_v, slots)
    cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slots.to(slot_dtype))
    assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16))


def _pages(layers, blocks, kv_heads, block_size, head_dim, device, gen, pin=False):
    shape = (layers, blocks, kv_heads, block_size, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    if device == "cpu":
        k, v = k.cpu().pin_memory(), v.cpu().pin_memory()
    return k, v


@pytest.mark.parametrize("direction", ["gpu_to_cpu", "cpu_to_gpu", "gpu_to_gpu"])
@pytest.mark.parametrize("mapping_on", ["cuda", "cpu"])
def test_swap_blocks_bit_exact(kern, direction, mapping_on):
    _, cache_ops = kern
    gen = torch.Generator(device="cuda").manual_seed(len(direction) + len(mapping_on))
    src_dev, dst_dev = {"gpu_to_cpu": ("cuda", "cpu"), "cpu_to_gpu": ("cpu", "cuda"),
                        "gpu_to_gpu": ("cuda", "cuda")}[direction]
    layers, kv_heads, block_size, head_dim = 4, 2, 16, 128
    src_k, src_v = _pages(layers, 50, kv_heads, block_size, head_dim, src_dev, gen)
    dst_k, dst_v = _pages(layers, 30, kv_heads, block_size, head_dim, dst_dev, gen)
    src_ids = torch.randperm(50, generator=gen, device="cuda")[:20]
    dst_ids = torch.randperm(30, generator=gen, device="cuda")[:20]
    mapping = torch.stack([src_ids, dst_ids], 1).to(torch.int64).to(mapping_on)
    expect_k, expect_v = dst_k.clone(), dst_v.clone()
    ref.swap_blocks(src_k, src_v, expect_k, expect_v, mapping)
    cache_ops.swap_blocks(src_k, src_v, dst_k, dst_v, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst_k.view(torch.int16), expect_k.view(torch.int16))
    assert torch.equal(dst_v.view(torch.int16), expect_v.view(torch.int16))


def test_copy_blocks_bit_exact(kern):
    _, cache_ops = kern
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_cache, v_cache = _pages(3, 200, 8, 16, 128, "cuda", gen)
    ids = torch.randperm(200, generator=gen, device="cuda")
    mapping = torch.stack([ids[:60], ids[60:120]], 1).to(torch.int64)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    ref.copy_blocks(expect_k, expect_v, mapping)
    cache_ops.copy_blocks(k_cache, v_cache, mapping)
    assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16))


def test_unpinned_cpu_pages_are_refused(kern):
    _, cache_ops = kern
    gpu = torch.zeros(1, 4, 1, 16, 8, dtype=torch.bfloat16, device="cuda")
    cpu = torch.zeros(1, 4, 1, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pinned"):
        cache_ops.swap_blocks(gpu, gpu, cpu, cpu, torch.tensor([[0, 1]]))


def decode_step_buffers(seq_lens, heads, kv_heads, head_dim):
    """A captured decode step's static inputs, bf16 on the GPU, uninitialised: q, key, value,
    seq_lens, out (q, out: [num_seqs, heads, head_dim]; key, value: [num_seqs, kv_heads, head_dim];
    seq_lens: [num_seqs] int32)."""
    num_seqs = len(seq_lens)
    q = torch.empty(num_seqs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    key = torch.empty(num_seqs, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, key, torch.empty_like(key), lens, torch.empty_like(q)


def last_slots(tables, seq_lens, block_size):
    """Each sequence's last token's cache slot through its block table: [num_seqs] int64."""
    return torch.tensor([tables[i, (n - 1) // block_size].item() * block_size + (n - 1) % block_size
                         for i, n in enumerate(seq_lens)], dtype=torch.int64, device="cuda")


def capture(step) -> torch.cuda.CUDAGraph:
    """step() run once eagerly on a side stream (compiles, sizes the workspaces), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.parametrize("features", ["none", "w100_cap50"])
def test_cuda_graph_capture_decode_and_cache_write(kern, features):
    """Capture cache write + split decode (+ combine) once; replay on new inputs written in place
    (a layer's window and soft-cap are captured with the launch)."""
    attention, cache_ops = kern
    window, cap, q_scale = FEATURES.get(features, (None, None, 1.0))
    gen = torch.Generator(device="cuda").manual_seed(13)
    heads, kv_heads, head_dim, block_size = 16, 4, 128, 16
    seq_lens = [3000, 17, 1200, 1]
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, torch.bfloat16,
                                           gen, spare=8, width_extra=2)
    num_seqs = len(seq_lens)
    q, key, value, lens, out = decode_step_buffers(seq_lens, heads, kv_heads, head_dim)
    slots = last_slots(tables, seq_lens, block_size)

    def step():
        cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
        attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out,
                                         sliding_window=window, soft_cap=cap)

    for t in (q, key, value):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
    graph = capture(step)
    for new_lens in ([2990, 5, 1201, 1], [3001, 30, 700, 16]):
        for t in (q, key, value):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        q.mul_(q_scale)
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        slots.copy_(last_slots(tables, new_lens, block_size))
        out.fill_(float("nan"))
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        ref.reshape_and_cache(key, value, expect_k, expect_v, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16))
        assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16))
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
        check_attention(out, q, k_cache, v_cache, tables, cu, lens, head_dim**-0.5, window, cap)


# -- FP8 (e4m3) KV cache ---------------------------------------------------------------------------
# The kernels over an FP8 cache (csrc/kv_fp8.cu) against float64 over the same pages dequantized
# as the reference twin reads them (x * scale in float32), by check_attention's bound with torch
# in the kernel's dtype over those pages rounded to it; the cache writes byte for byte against
# the twin's rule; pages moved as bytes.

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def kern_fp8(kern):
    """(attention, cache_ops, ops), the FP8 cache's module compiled first (its own failure)."""
    from pagedserve_kernels import _compile, ops

    _compile.get_module("kv_fp8")
    return (*kern, ops)


def fp8_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, gen, spare=5, width_extra=1):
    """paged_cache's pages written to an FP8 cache as the twin writes them, with per-layer
    scales near amax / 448 (a calibrated checkpoint's; the largest values saturate): (k_cache,
    v_cache, block_tables, k_scale, v_scale), the scales [] float32 on the GPU."""
    k, v, tables = paged_cache(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, gen,
                               spare, width_extra)
    scales = 0.009 + 0.004 * torch.rand(2, generator=gen, device="cuda")  # [2]
    k_scale, v_scale = scales[0].clone(), scales[1].clone()
    return ref.quantize_kv(k, k_scale), ref.quantize_kv(v, v_scale), tables, k_scale, v_scale


def check_attention_fp8(out, q, k_cache, v_cache, k_scale, v_scale, tables, cu, seq_lens, scale,
                        window=None, cap=None):
    """check_attention over an FP8 cache: float64 over the dequantized pages; the baseline is
    torch in q's dtype over those pages rounded to it."""
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    k_deq, v_deq = ref.dequantize_kv(k_cache, k_scale), ref.dequantize_kv(v_cache, v_scale)
    starts, lens = cu.tolist(), seq_lens.tolist()
    for i, n in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        k = ref.gather_kv(k_deq, tables[i], n)  # [n, kv_heads, hd] float32
        v = ref.gather_kv(v_deq, tables[i], n)
        ref64 = ref._attend(q[a:b].double(), k.double(), v.double(), scale, window, cap)
        base = rel_err(torch_in_dtype(q[a:b], k.to(q.dtype), v.to(q.dtype), scale, window, cap),
                       ref64)
        err = rel_err(out[a:b], ref64)
        assert err <= 2 * base + FLOOR, (f"seq {i} (q_len {b - a}, ctx {n}, window {window}, cap "
                                         f"{cap}): {err:.2e} vs torch {base:.2e}")


FP8_FEATURES = ["w1", "w17", "w129", "w700", "cap5", "cap50", "w33_cap5", "w100_cap50"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
def test_fp8_prefill_matches_reference(kern_fp8, variant, dtype, head_dim, heads, kv_heads,
                                       block_size, case):
    _check_fp8_prefill(kern_fp8, dtype, head_dim, heads, kv_heads, block_size, case, variant)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", FP8_FEATURES)
@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
def test_fp8_prefill_window_and_soft_cap(kern_fp8, variant, dtype, head_dim, features):
    _check_fp8_prefill(kern_fp8, dtype, head_dim, 8, 2, 16, "window", variant,
                       FEATURES[features])


def _check_fp8_prefill(kern_fp8, dtype, head_dim, heads, kv_heads, block_size, case, variant,
                       features=(None, None, 1.0)):
    attention = kern_fp8[0]
    window, cap, q_scale = features
    seq_lens, q_lens = WINDOW_PREFILL_CASE if case == "window" else PREFILL_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8", case, dtype, head_dim, heads,
                                                             block_size, features))
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_cache(seq_lens, kv_heads, head_dim,
                                                                 block_size, gen)
    q = (torch.randn(sum(q_lens), heads, head_dim, generator=gen, device="cuda") * q_scale).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    attention.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, out=out,
                                      sliding_window=window, soft_cap=cap, k_scale=k_scale,
                                      v_scale=v_scale, variant=variant)
    check_attention_fp8(out, q, k_cache, v_cache, k_scale, v_scale, tables, cu, lens, scale,
                        window, cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (16, 1)])  # 64, 16, 4 tokens a CTA
@pytest.mark.parametrize("case", list(FEW_QUERY_CASES))
def test_fp8_few_query_matches_reference(kern_fp8, dtype, head_dim, heads, kv_heads, case):
    _check_fp8_few_query(kern_fp8, dtype, head_dim, heads, kv_heads, 16, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(8, 8, 16), (16, 1, 32)])
@pytest.mark.parametrize("features", ["w17", "cap50", "w100_cap50"])
def test_fp8_few_query_window_and_soft_cap(kern_fp8, dtype, head_dim, heads, kv_heads, block_size,
                                           features):
    _check_fp8_few_query(kern_fp8, dtype, head_dim, heads, kv_heads, block_size, "window",
                         FEATURES[features])


def _check_fp8_few_query(kern_fp8, dtype, head_dim, heads, kv_heads, block_size, case,
                         features=(None, None, 1.0)):
    attention = kern_fp8[0]
    window, cap, q_scale = features
    seq_lens, q_lens = WINDOW_FEW_QUERY_CASE if case == "window" else FEW_QUERY_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8_few", case, dtype, head_dim,
                                                             heads, block_size, features))
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_cache(seq_lens, kv_heads, head_dim,
                                                                 block_size, gen, width_extra=3)
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim, generator=gen, device="cuda")
    q = (qkv * q_scale).to(dtype)[:, :heads]  # a strided view, as the model passes it
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    attention.paged_few_query_attention(q, k_cache, v_cache, tables, cu, lens, scale, out=out,
                                        sliding_window=window, soft_cap=cap, k_scale=k_scale,
                                        v_scale=v_scale)
    check_attention_fp8(out, q, k_cache, v_cache, k_scale, v_scale, tables, cu, lens, scale,
                        window, cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_fp8_decode_matches_reference(kern_fp8, dtype, head_dim, heads, kv_heads, block_size,
                                      case):
    _check_fp8_decode(kern_fp8, dtype, head_dim, heads, kv_heads, block_size, decode_lens(case),
                      {}, seed=seed_of("fp8_dec", case, dtype, head_dim, heads, block_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", ["w17", "w129", "cap50", "w100_cap50"])
@pytest.mark.parametrize("policy", ["default", "short_splits"])
def test_fp8_decode_window_and_soft_cap(kern_fp8, dtype, head_dim, features, policy):
    """One split a seq, and many short ones merged by the combine."""
    options = {} if policy == "default" else dict(ctas_per_sm=24, max_pages=8)
    _check_fp8_decode(kern_fp8, dtype, head_dim, 16, 2, 32, WINDOW_DECODE_LENS, options,
                      FEATURES[features],
                      seed=seed_of("fp8_dwin", dtype, head_dim, features, policy))


def _check_fp8_decode(kern_fp8, dtype, head_dim, heads, kv_heads, block_size, seq_lens, options,
                      features=(None, None, 1.0), seed=0):
    attention = kern_fp8[0]
    window, cap, q_scale = features
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_cache(seq_lens, kv_heads, head_dim,
                                                                 block_size, gen, width_extra=3)
    q = (torch.randn(len(seq_lens), heads, head_dim, generator=gen, device="cuda") * q_scale).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out,
                                     sliding_window=window, soft_cap=cap, k_scale=k_scale,
                                     v_scale=v_scale, **options)
    empty = lens == 0  # a zero row, as documented
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    keep = (~empty).nonzero().flatten()
    cu = torch.arange(len(keep) + 1, dtype=torch.int32, device="cuda")
    check_attention_fp8(out[keep], q[keep], k_cache, v_cache, k_scale, v_scale, tables[keep], cu,
                        lens[keep], head_dim**-0.5, window, cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kernel", ["decode", "few_query", *PREFILL_VARIANTS])
def test_fp8_pages_read_back_exactly(kern_fp8, dtype, head_dim, kernel):
    """Every e4m3 code, NaN included, read by each attention kernel as the twin reads it: one key
    a sequence, so its softmax weight is exactly 1 and, with v_scale 1, the output row is the V
    row converted; each sequence's V holds all 256 codes in another order."""
    attention = kern_fp8[0]
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8_codes", dtype, head_dim, kernel))
    kv_heads, block_size, num_seqs = 256 // head_dim, 16, 5
    heads = 2 * kv_heads
    shape = (num_seqs + 3, kv_heads, block_size, head_dim)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], device="cuda")
    k_cache = finite[torch.randint(0, len(finite), shape, generator=gen, device="cuda")]
    v_cache = torch.randint(0, 256, shape, generator=gen, device="cuda")
    tables = torch.randperm(shape[0], generator=gen, device="cuda")[:num_seqs].to(torch.int32)
    for block in tables.tolist():
        order = torch.randperm(256, generator=gen, device="cuda")
        v_cache[block, :, 0] = order.view(kv_heads, head_dim)
    k_cache, v_cache = (c.to(torch.uint8).view(FP8) for c in (k_cache, v_cache))
    q = torch.randn(num_seqs, heads, head_dim, generator=gen, device="cuda").to(dtype)
    lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    k_scale, v_scale = torch.tensor(0.01, device="cuda"), torch.tensor(1.0, device="cuda")
    out = torch.zeros_like(q)
    scales = dict(k_scale=k_scale, v_scale=v_scale, out=out)
    tables = tables.view(num_seqs, 1)
    if kernel == "decode":
        attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, **scales)
    elif kernel == "few_query":
        attention.paged_few_query_attention(q, k_cache, v_cache, tables, cu, lens, 0.1, **scales)
    else:
        attention.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1,
                                          variant=kernel, **scales)
    want = v_cache[tables.flatten().long(), :, 0].float()  # [seqs, kv_heads, hd], NaN codes NaN
    want = want.repeat_interleave(heads // kv_heads, dim=1)
    assert torch.isnan(want).sum() == 2 * num_seqs * heads // kv_heads
    torch.testing.assert_close(out.float(), want, rtol=0, atol=0, equal_nan=True)


def fp8_special_values(scale: float) -> torch.Tensor:
    """x such that x / scale (scale a power of two: exact) is every e4m3 value and every midpoint
    of two neighbours (ties, to even), past the range, infinite, or below the subnormals; zeros
    of both signs. float32 [n], all but 1e4 exact in bf16 and fp16."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    values = codes[torch.isfinite(codes)].unique()  # sorted, -448..448
    mids = (values[1:] + values[:-1]) / 2
    edges = torch.tensor([460.0, 464.0, 1e4, float("inf"), 2.0**-11, 3 * 2.0**-11, 0.0])
    special = torch.cat([values, mids, edges, -edges])
    return (special * scale).cuda()


@pytest.mark.parametrize("row_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim,kv_heads,block_size", [(128, 8, 16), (64, 1, 32), (40, 2, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_fp8_reshape_and_cache_bit_exact(kern_fp8, row_dtype, head_dim, kv_heads, block_size,
                                         slot_dtype):
    """The FP8 cache write against the twin's (x / scale in float32, saturated at +-448, rounded
    to nearest even) byte for byte: random rows (a scale near their amax / 448 for v), and k rows
    holding fp8_special_values at a power-of-two k_scale; strided views of a fused projection;
    slots -1 write nothing; untouched slots keep their bytes."""
    _, cache_ops, _ = kern_fp8
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8_write", row_dtype, head_dim,
                                                             kv_heads, slot_dtype))
    num_blocks, num_tokens = 64, 300
    k_scale = torch.tensor(2.0**-6, device="cuda")
    v_scale = torch.tensor(0.0123, device="cuda")
    fused = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=gen, device="cuda") * 2
    special = fp8_special_values(2.0**-6)
    k_part = fused[:, kv_heads : 2 * kv_heads].reshape(-1)
    k_part[: len(special)] = special
    fused[:, kv_heads : 2 * kv_heads] = k_part.view(num_tokens, kv_heads, head_dim)
    fused = fused.to(row_dtype)
    key, value = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8).view(FP8)
    v_cache = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8).view(FP8)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[1::7] = -1
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(key, value, expect_k, expect_v, slots, k_scale, v_scale)
    cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slots.to(slot_dtype), k_scale,
                                v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,interleaved",
                         [(128, 128, False), (64, 64, True), (128, 64, False), (72, 32, True),
                          (72, 72, False)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_fp8_rotary_embedding_and_cache(kern_fp8, dtype, head_dim, rotary_dim, interleaved,
                                        slot_dtype):
    """The fused RoPE + FP8 cache write against RoPE then the FP8 cache write on copies (q, k,
    the qkv buffer and both caches bit for bit), and its cache against the twin's write of the
    rotated k and v, byte for byte. Partial rotary (k's tail cached by its own units); (72, 72):
    half the span is not whole vectors, so the launcher takes the two launches itself."""
    from tests.kernels.test_ops_gpu import qkv_views, rope_tables  # that module imports this one

    _, cache_ops, ops = kern_fp8
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8_rope", dtype, head_dim,
                                                             rotary_dim, interleaved, slot_dtype))
    num_tokens, heads, kv_heads, block_size = 70, 9, 3, 16
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    num_blocks = num_tokens // block_size + 3
    qkv = (torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen, device="cuda") * 2).to(dtype)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8).view(FP8)
    v_cache = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8).view(FP8)
    k_scale, v_scale = torch.tensor(0.0113, device="cuda"), torch.tensor(0.0157, device="cuda")
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::5] = -1
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device="cuda")
    cos_table, sin_table = rope_tables(rotary_dim)

    def views(buf):
        return qkv_views(buf, heads, kv_heads, head_dim)

    two = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = views(two[0])
    ops.rotary_embedding(positions, q, k, cos_table, sin_table, interleaved)
    cache_ops.reshape_and_cache(k, v, two[1], two[2], slots.to(slot_dtype), k_scale, v_scale)
    twin = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(k, v, twin[0], twin[1], slots, k_scale, v_scale)
    q, k, v = views(qkv)
    ops.rotary_embedding_and_cache(positions, q, k, v, cos_table, sin_table, k_cache, v_cache,
                                   slots.to(slot_dtype), interleaved, k_scale, v_scale)
    assert torch.equal(qkv, two[0]), "q / k differ from the two launches"
    for name, got, want in (("k_cache", k_cache, two[1]), ("v_cache", v_cache, two[2]),
                            ("k_cache (twin)", k_cache, twin[0]),
                            ("v_cache (twin)", v_cache, twin[1])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def _fp8_pages(layers, blocks, device, gen):
    """Random FP8 pages (any byte, NaN codes included) [layers, blocks, 2, 16, 128], K and V,
    pinned on the CPU."""
    shape = (layers, blocks, 2, 16, 128)
    k, v = (torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)
            for _ in range(2))
    if device == "cpu":
        k, v = k.cpu().pin_memory(), v.cpu().pin_memory()
    return k.view(FP8), v.view(FP8)


@pytest.mark.parametrize("direction", ["gpu_to_cpu", "cpu_to_gpu", "gpu_to_gpu", "copy"])
def test_fp8_pages_swap_and_copy_bit_exact(kern_fp8, direction):
    """swap_blocks (pinned CPU swap space both ways, GPU to GPU) and copy_blocks move FP8 pages
    as bytes, as the twins do; pages not in the mapping stay as they were."""
    _, cache_ops, _ = kern_fp8
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8_pages", direction))
    if direction == "copy":
        k, v = _fp8_pages(3, 200, "cuda", gen)
        ids = torch.randperm(200, generator=gen, device="cuda")
        mapping = torch.stack([ids[:60], ids[60:120]], 1).to(torch.int64)
        expect_k, expect_v = k.view(torch.uint8).clone(), v.view(torch.uint8).clone()
        ref.copy_blocks(expect_k, expect_v, mapping)
        cache_ops.copy_blocks(k, v, mapping)
        got_k, got_v = k, v
    else:
        src_dev, dst_dev = {"gpu_to_cpu": ("cuda", "cpu"), "cpu_to_gpu": ("cpu", "cuda"),
                            "gpu_to_gpu": ("cuda", "cuda")}[direction]
        src_k, src_v = _fp8_pages(4, 50, src_dev, gen)
        got_k, got_v = _fp8_pages(4, 30, dst_dev, gen)
        ids = torch.stack([torch.randperm(50, generator=gen, device="cuda")[:20],
                           torch.randperm(30, generator=gen, device="cuda")[:20]], 1)
        mapping = ids.to(torch.int64)
        expect_k, expect_v = got_k.view(torch.uint8).clone(), got_v.view(torch.uint8).clone()
        ref.swap_blocks(src_k.view(torch.uint8), src_v.view(torch.uint8), expect_k, expect_v,
                        mapping)
        cache_ops.swap_blocks(src_k, src_v, got_k, got_v, mapping)
    torch.cuda.synchronize()
    assert torch.equal(got_k.view(torch.uint8), expect_k)
    assert torch.equal(got_v.view(torch.uint8), expect_v)


@pytest.mark.parametrize("features", ["none", "w100_cap50"])
def test_fp8_cuda_graph_capture_decode_and_cache_write(kern_fp8, features):
    """Capture the FP8 cache write + split decode (+ combine) once; replay on new inputs written
    in place, then with the layer's scales changed in place: the kernels read them at replay."""
    attention, cache_ops, _ = kern_fp8
    window, cap, q_scale = FEATURES.get(features, (None, None, 1.0))
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fp8_graph", features))
    heads, kv_heads, head_dim, block_size = 16, 4, 128, 16
    seq_lens = [3000, 17, 1200, 1]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_cache(seq_lens, kv_heads, head_dim,
                                                                 block_size, gen, spare=8,
                                                                 width_extra=2)
    num_seqs = len(seq_lens)
    q, key, value, lens, out = decode_step_buffers(seq_lens, heads, kv_heads, head_dim)
    slots = last_slots(tables, seq_lens, block_size)

    def step():
        cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
        attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out,
                                         sliding_window=window, soft_cap=cap, k_scale=k_scale,
                                         v_scale=v_scale)

    for t in (q, key, value):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
    graph = capture(step)
    for new_lens, scales in (([2990, 5, 1201, 1], None), ([3001, 30, 700, 16], None),
                             ([3002, 31, 701, 17], (0.021, 0.0071))):
        for t in (q, key, value):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        q.mul_(q_scale)
        if scales is not None:
            k_scale.fill_(scales[0])
            v_scale.fill_(scales[1])
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        slots.copy_(last_slots(tables, new_lens, block_size))
        out.fill_(float("nan"))
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        ref.reshape_and_cache(key, value, expect_k, expect_v, slots, k_scale, v_scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8))
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
        check_attention_fp8(out, q, k_cache, v_cache, k_scale, v_scale, tables, cu, lens,
                            head_dim**-0.5, window, cap)


def test_fp8_cache_needs_the_layers_scales_and_a_production_kernel(kern_fp8):
    """An FP8 cache without its scales (or with scales not one float32 on the cache's device) is
    refused naming the argument; candidates with no FP8 kernel are refused by name."""
    attention, cache_ops, _ = kern_fp8
    gen = torch.Generator(device="cuda").manual_seed(17)
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_cache([40], 2, 64, 16, gen)
    q = torch.randn(1, 8, 64, generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([40], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")

    def decode(**kw):
        return attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, **kw)

    with pytest.raises(ValueError, match="needs k_scale"):
        decode()
    with pytest.raises(ValueError, match="needs v_scale"):
        decode(k_scale=k_scale, v_scale=v_scale.double())
    with pytest.raises(ValueError, match="needs k_scale"):
        decode(k_scale=k_scale.cpu(), v_scale=v_scale)
    with pytest.raises(ValueError, match="needs k_scale"):
        decode(k_scale=torch.ones(2, device="cuda"), v_scale=v_scale)
    with pytest.raises(ValueError, match="no kernel over an FP8 cache"):
        decode(k_scale=k_scale, v_scale=v_scale, variant="s2")
    with pytest.raises(ValueError, match="no kernel over an FP8 cache"):
        attention.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1,
                                          k_scale=k_scale, v_scale=v_scale, variant="wg1")
    with pytest.raises(ValueError, match="key_split"):
        attention.paged_few_query_attention(q, k_cache, v_cache, tables, cu, lens, 0.1,
                                            k_scale=k_scale, v_scale=v_scale, key_split=True)
    with pytest.raises(ValueError, match="v_cache must be"):
        attention.paged_decode_attention(q, k_cache, v_cache.view(torch.uint8), tables, lens, 0.1,
                                         k_scale=k_scale, v_scale=v_scale)
    key = torch.randn(1, 2, 64, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([3], device="cuda")
    with pytest.raises(ValueError, match="needs k_scale"):
        cache_ops.reshape_and_cache(key, key, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="bf16/fp16/float32"):
        cache_ops.reshape_and_cache(key.to(FP8), key.to(FP8), k_cache, v_cache, slots, k_scale,
                                    v_scale)
    out = decode(k_scale=k_scale, v_scale=v_scale)  # and with them, it runs
    check_attention_fp8(out, q, k_cache, v_cache, k_scale, v_scale, tables, cu, lens, 0.1)


def test_fp8_torch_twins_read_an_fp8_cache_on_the_gpu(kern_fp8):
    """The CUDA backend's fallbacks (a head size the kernels do not cover, a float32 model): the
    twins over an FP8 cache on the GPU equal themselves over its pages dequantized to float32."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    seq_lens = [70, 33, 200]
    k8, v8, tables, k_scale, v_scale = fp8_paged_cache(seq_lens, 2, 96, 16, gen)
    k32, v32 = ref.dequantize_kv(k8, k_scale), ref.dequantize_kv(v8, v_scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 8, 96, generator=gen, device="cuda")
    got = ref.torch_decode_attention(q, k8, v8, tables, lens, 0.1, None, 33, None, k_scale, v_scale)
    want = ref.torch_decode_attention(q, k32, v32, tables, lens, 0.1, None, 33, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    q = torch.randn(76, 8, 96, generator=gen, device="cuda")
    cu = torch.tensor([0, 70, 75, 76], dtype=torch.int32, device="cuda")
    got = ref.paged_prefill_attention(q, k8, v8, tables, cu, lens, 0.1, k_scale=k_scale,
                                      v_scale=v_scale)
    want = ref.paged_prefill_attention(q, k32, v32, tables, cu, lens, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
