"""The CuPy kernels against their torch reference twins on the GPU.

Attention: per sequence, ||kernel - ref64|| / ||ref64|| must stay within 2x the same error of torch
doing the computation in the kernel's dtype (SDPA in bf16/fp16), plus a 1e-3 floor; outputs are
poisoned with NaN first. Copies: bit-exact, untouched pages unchanged. Fresh random inputs per case.
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


def torch_in_dtype(q, k, v, scale):
    """Same attention by torch SDPA in q's dtype: q [q_len, H, D], k/v [ctx, KVH, D]."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def check_attention(out, q, k_cache, v_cache, tables, cu, seq_lens, scale):
    """Per sequence: the float64 result (the reference twin's computation, done by SDPA in float64
    on the GPU) against the kernel and against torch in the kernel's dtype."""
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    starts, lens = cu.tolist(), seq_lens.tolist()
    for i, n in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        k = ref.gather_kv(k_cache, tables[i], n)
        v = ref.gather_kv(v_cache, tables[i], n)
        ref64 = torch_in_dtype(q[a:b].double(), k.double(), v.double(), scale)
        base = rel_err(torch_in_dtype(q[a:b], k, v, scale), ref64)
        err = rel_err(out[a:b], ref64)
        assert err <= 2 * base + FLOOR, f"seq {i} (q_len {b - a}, ctx {n}): {err:.2e} vs torch {base:.2e}"


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
    "chunked": ([200, 1000, 77, 640], [64, 129, 77, 1]),
    "long": ([2048], [2048]),
}


@pytest.fixture(params=["default", "mma_sync"])
def prefill_impl(request, kern):
    """The default prefill kernels (wgmma on Hopper), then the mma.sync fallback kernels."""
    attention, _ = kern
    saved = dict(attention.PREFILL_KERNELS)
    if request.param == "mma_sync":
        attention.PREFILL_KERNELS.update(attention.PREFILL_KERNELS_MMA_SYNC)
    yield request.param
    attention.PREFILL_KERNELS.update(saved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_reference(kern, prefill_impl, dtype, head_dim, heads, kv_heads, block_size,
                                   case):
    _check_prefill(kern, dtype, head_dim, heads, kv_heads, block_size, case)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_candidate_wg1_hd64(kern, heads, kv_heads, block_size, case):
    """The benchmark's comparison variant (wgmma hd64 at 1 CTA/SM), and block size 8."""
    attention, _ = kern
    key = (torch.bfloat16, 64)
    saved = attention.PREFILL_KERNELS[key]
    attention.PREFILL_KERNELS[key] = "prefill_wg1_bf16_hd64"
    try:
        _check_prefill(kern, torch.bfloat16, 64, heads, kv_heads, block_size, case)
    finally:
        attention.PREFILL_KERNELS[key] = saved


def _check_prefill(kern, dtype, head_dim, heads, kv_heads, block_size, case):
    attention, _ = kern
    seq_lens, q_lens = PREFILL_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed_of(case, dtype, head_dim, heads, block_size))
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen, device="cuda").to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    attention.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, out=out)
    check_attention(out, q, k_cache, v_cache, tables, cu, lens, scale)


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
                                              case, key_split, monkeypatch):
    """paged_few_query_attention against float64 with paged_prefill_attention's semantics, q as a
    strided view (as the model passes it), outputs poisoned with NaN."""
    attention, _ = kern
    monkeypatch.setattr(attention, "FEW_QUERY_KEY_SPLIT", key_split)
    seq_lens, q_lens = FEW_QUERY_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed_of("few", case, dtype, head_dim, heads,
                                                             block_size))
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen,
                                           width_extra=3)
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim, generator=gen, device="cuda")
    q = qkv.to(dtype)[:, :heads]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    attention.paged_few_query_attention(q, k_cache, v_cache, tables, cu, lens, scale, out=out)
    check_attention(out, q, k_cache, v_cache, tables, cu, lens, scale)


DECODE_CASES = {
    # name: context lengths
    "few_long": [16384, 5000, 1],
    "mixed": [1, 15, 16, 17, 31, 32, 33, 1000, 4097, 257],
    "many_short": "256x1..600",
}


def decode_lens(case, gen):
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
    attention, _ = kern
    gen = torch.Generator(device="cuda").manual_seed(seed_of(case, dtype, head_dim, heads, block_size))
    seq_lens = decode_lens(case, gen)
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen,
                                           width_extra=3)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen, device="cuda").to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda")
    check_attention(out, q, k_cache, v_cache, tables, cu, lens, head_dim**-0.5)


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("ctas_per_sm", [None, 4, 24])
def test_decode_candidate_kernel_and_split_policies(kern, case, ctas_per_sm):
    """The 2-stage hd128 candidate the benchmark times, and other split counts, stay correct."""
    attention, _ = kern
    gen = torch.Generator(device="cuda").manual_seed(seed_of("cand", case, ctas_per_sm))
    seq_lens = decode_lens(case, gen)
    k_cache, v_cache, tables = paged_cache(seq_lens, 8, 128, 16, torch.bfloat16, gen, width_extra=3)
    q = torch.randn(len(seq_lens), 32, 128, generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda")
    key = (torch.bfloat16, 128)
    saved = (attention.DECODE_KERNELS[key], attention.DECODE_CTAS_PER_SM,
             attention.DECODE_CTAS_PER_SM_MANY)
    for variant in (saved[0], ("decode_s2_bf16_hd128", 2)):
        attention.DECODE_KERNELS[key] = variant
        if ctas_per_sm:  # few seqs or many alike
            attention.DECODE_CTAS_PER_SM = attention.DECODE_CTAS_PER_SM_MANY = ctas_per_sm
        try:
            out = torch.full_like(q, float("nan"))
            attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, out=out)
        finally:
            (attention.DECODE_KERNELS[key], attention.DECODE_CTAS_PER_SM,
             attention.DECODE_CTAS_PER_SM_MANY) = saved
        check_attention(out, q, k_cache, v_cache, tables, cu, lens, 128**-0.5)


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


def test_cuda_graph_capture_decode_and_cache_write(kern):
    """Capture cache write + split decode (+ combine) once; replay on new inputs written in place."""
    attention, cache_ops = kern
    gen = torch.Generator(device="cuda").manual_seed(13)
    heads, kv_heads, head_dim, block_size = 16, 4, 128, 16
    seq_lens = [3000, 17, 1200, 1]
    k_cache, v_cache, tables = paged_cache(seq_lens, kv_heads, head_dim, block_size, torch.bfloat16,
                                           gen, spare=8, width_extra=2)
    num_seqs = len(seq_lens)
    q = torch.empty(num_seqs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    key = torch.empty(num_seqs, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    value = torch.empty_like(key)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def last_slots(lens_list):
        return torch.tensor([tables[i, (n - 1) // block_size].item() * block_size + (n - 1) % block_size
                             for i, n in enumerate(lens_list)], dtype=torch.int64, device="cuda")

    slots = last_slots(seq_lens)

    def step():
        cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
        attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out)

    for t in (q, key, value):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager warm-up: compiles, sizes the workspaces
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens in ([2990, 5, 1201, 1], [3001, 30, 700, 16]):
        for t in (q, key, value):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        slots.copy_(last_slots(new_lens))
        out.fill_(float("nan"))
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        ref.reshape_and_cache(key, value, expect_k, expect_v, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16))
        assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16))
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
        check_attention(out, q, k_cache, v_cache, tables, cu, lens, head_dim**-0.5)
