"""CPU checks of the kernel launchers: input validation raises ValueError before any launch, the
decode split plan (with and without a window), kernel variants by argument, the source loader
and the garbage collector's pause around captures (CI; needs neither CuPy nor a GPU)."""
from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pagedserve_kernels import _compile, attention, cache_ops, ops


def test_importing_launchers_does_not_import_cupy():
    code = ("import sys, pagedserve_kernels, pagedserve_kernels.attention, "
            "pagedserve_kernels.cache_ops, pagedserve_kernels.ops, pagedserve_kernels._compile; "
            "assert 'cupy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_the_collector_stays_paused_until_the_last_capture_ends_and_then_as_it_was():
    """Nested and overlapping pauses (two threads capturing) keep the collector off until the
    last one ends, then leave it as it was before the first: on, or off where the caller had
    turned it off."""
    assert gc.isenabled()
    outer_in, inner_done = threading.Event(), threading.Event()

    def other_thread():
        with _compile.collector_paused():
            outer_in.set()
            inner_done.wait(10)

    thread = threading.Thread(target=other_thread)
    with _compile.collector_paused():
        assert not gc.isenabled()
        with _compile.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        thread.start()
        outer_in.wait(10)
    assert not gc.isenabled()  # the other thread still captures
    inner_done.set()
    thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with _compile.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_prefill_rejects_cpu_and_bad_dtypes():
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(10, 2, 16, 128, dtype=torch.bfloat16)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        attention.paged_prefill_attention(q, kc, kc, idx.view(1, 2), idx, idx[:1], 0.1)
    with pytest.raises(ValueError, match="CUDA"):
        attention.paged_decode_attention(q.float(), kc, kc, idx.view(1, 2), idx[:1], 0.1)


def test_swap_requires_a_gpu_side_and_pinned_pages():
    t = torch.zeros(1, 4, 1, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        cache_ops.swap_blocks(t, t, t, t, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        cache_ops.swap_blocks(t, t, t, t, torch.tensor([0, 1]))


def test_workspaces_are_the_current_scratch_tensors(monkeypatch):
    monkeypatch.setattr(attention, "_workspaces", {})
    cpu = torch.device("cpu")
    small = attention._workspace("decode_partials", cpu, 8, torch.float32)
    assert [id(t) for t in attention.workspaces()] == [id(small)]
    kept = attention.workspaces()  # what a graph captured with `small` holds
    grown = attention._workspace("decode_partials", cpu, 64, torch.float32)
    assert grown is not small and [id(t) for t in attention.workspaces()] == [id(grown)]
    assert kept[0] is small


@pytest.mark.parametrize("num_seqs,max_blocks,block_size", [(64, 256, 16), (256, 64, 16), (1, 1024, 16),
                                                           (3, 2000, 32), (8, 1, 16)])
def test_decode_split_plan_covers_every_page(num_seqs, max_blocks, block_size):
    splits, chunk = attention.decode_splits(num_seqs, 8, max_blocks, block_size, num_sms=132)
    assert splits * chunk >= max_blocks > (splits - 1) * chunk
    assert chunk <= attention._DECODE_MAX_PAGES
    assert (chunk * block_size) % 64 == 0 or chunk * block_size >= max_blocks * block_size


def test_decode_splits_aim_fewer_ctas_per_sm_once_seqs_are_many():
    """Few seqs: splits for ~DECODE_CTAS_PER_SM CTAs per SM; from DECODE_MANY_PAIRS_PER_SM (seq,
    kv head) pairs per SM up, DECODE_CTAS_PER_SM_MANY: a W1 decode graph's 512-page tables then
    give one split a seq, however wide the table."""
    sms, kv = 132, 8
    edge = -(-attention.DECODE_MANY_PAIRS_PER_SM * sms // kv)  # fewest seqs counted as many
    few = attention.decode_splits(edge - 1, kv, 512, 16, sms)[0]
    assert few == -(-attention.DECODE_CTAS_PER_SM * sms // ((edge - 1) * kv)) > 1
    assert attention.decode_splits(edge, kv, 512, 16, sms)[0] == \
        -(-attention.DECODE_CTAS_PER_SM_MANY * sms // (edge * kv))
    assert attention.decode_splits(256, kv, 512, 16, sms) == (1, 512)
    assert attention.decode_splits(128, kv, 512, 16, sms) == (1, 512)
    assert attention.decode_splits(128, kv, 512, 16, sms, ctas_per_sm=12)[0] == 2  # explicit
    assert attention.decode_splits(256, kv, 2048, 16, sms) == (2, 1024)  # the page-list bound


def test_sources_inline_local_headers_once():
    src = _compile.load_source("attention.cu")
    assert '#include "common.cuh"' not in src and src.count("struct Pack<__half>") == 1
    assert _compile.arch_options("90")[0] == ("-arch=sm_90a",)
    assert _compile.arch_options("80")[0] == ("-arch=sm_80",)


def test_elementwise_ops_reject_cpu_tensors():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    q, k = torch.zeros(4, 8, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(16, 64)
    for call in (lambda: ops.rms_norm(x, w, 1e-5), lambda: ops.fused_add_rms_norm(x, x, w, 1e-5),
                 lambda: ops.silu_and_mul(x), lambda: ops.quantize_fp8(x),
                 lambda: ops.silu_and_mul_fp8(x),
                 lambda: ops.rotary_embedding(torch.zeros(4, dtype=torch.int64), q, k, table, table),
                 lambda: ops.rotary_embedding_and_cache(
                     torch.zeros(4, dtype=torch.int64), q, k, k, table, table,
                     torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16),
                     torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64))):
        with pytest.raises(ValueError, match="CUDA"):
            call()


def test_vector_path_needs_aligned_rows_of_whole_vectors():
    buf = torch.zeros(4, 80, dtype=torch.bfloat16)
    assert ops._rows_aligned(64, buf[:, :64])  # row stride 160 B, start aligned
    assert not ops._rows_aligned(64, buf[:, 1:65])  # every row starts 2 bytes in
    assert not ops._rows_aligned(60, buf[:, :60])  # 60 is not whole 8-element vectors
    assert not ops._rows_aligned(64, torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64])  # 136 B rows
    assert [ops._threads(n, 1024) for n in (1, 72, 512, 5000)] == [32, 96, 512, 1024]


@pytest.fixture
def launches(monkeypatch):
    """ops' launches recorded instead of run, CPU tensors taken for the GPU's (the launchers'
    choices of kernel, grid, threads and arguments, without a device)."""
    recorded = []
    monkeypatch.setattr(ops, "_check_device", lambda name, t: None)
    monkeypatch.setattr(ops, "_launch", lambda kernel, like, grid, threads, args: recorded.append(
        (kernel, grid, threads, tuple(a if isinstance(a, int) else a.item() for a in args[2:]))))
    return recorded


def test_quantize_fp8_launches_a_cta_per_row_vectors_only_where_aligned(launches):
    """Args after (out, scales): x, its row stride, width, the scale floor, vec."""
    from pagedserve_kernels.reference import FP8_MIN_SCALE

    wide = torch.zeros(7, 4200, dtype=torch.bfloat16)
    floor = float(torch.tensor(FP8_MIN_SCALE, dtype=torch.float32))
    out, scales = ops.quantize_fp8(wide[:, :4096])  # rows 8,400 B apart: 16-byte aligned
    assert out.shape == (7, 4096) and out.dtype == torch.float8_e4m3fn
    assert scales.shape == (7, 1) and scales.dtype == torch.float32
    ops.quantize_fp8(wide[:, 1:4097])  # every row 2 bytes in: scalar
    ops.quantize_fp8(wide[:, :100].half())  # 100 is not whole vectors: scalar
    ops.quantize_fp8(wide[:0, :64])  # no rows: no launch
    ptr = wide.data_ptr()
    assert launches == [
        ("quantize_fp8_bf16", (7, 1, 1), 512, (ptr, 4200, 4096, floor, 1)),
        ("quantize_fp8_bf16", (7, 1, 1), 1024, (ptr + 2, 4200, 4096, floor, 0)),
        ("quantize_fp8_fp16", (7, 1, 1), 128, (launches[2][3][0], 100, 100, floor, 0)),
    ]


def test_silu_and_mul_fp8_launches_a_cta_per_row_of_gate_and_up(launches):
    """d = width / 2 outputs a row, vectors where gate's and up's rows are aligned; an odd width
    is a ValueError naming the layout."""
    x = torch.zeros(3, 2 * 14336, dtype=torch.bfloat16)
    out, scales = ops.silu_and_mul_fp8(x)
    assert out.shape == (3, 14336) and out.dtype == torch.float8_e4m3fn and scales.shape == (3, 1)
    ops.silu_and_mul_fp8(torch.zeros(5, 2 * 1003, dtype=torch.float16))  # up 2,006 B in: scalar
    assert [(k, grid, threads, args[1:3] + args[4:]) for k, grid, threads, args in launches] == [
        ("silu_and_mul_fp8_bf16", (3, 1, 1), 1024, (2 * 14336, 14336, 1)),
        ("silu_and_mul_fp8_fp16", (5, 1, 1), 1024, (2 * 1003, 1003, 0)),
    ]
    assert ops.silu_and_mul_fp8(x[:0])[0].shape == (0, 14336) and len(launches) == 2
    with pytest.raises(ValueError, match=r"\(gate \| up\)"):
        ops.silu_and_mul_fp8(torch.zeros(2, 7, dtype=torch.bfloat16))


def test_ops_module_lists_every_kernel_of_ops_cu():
    src = _compile.load_source("ops.cu")
    ops_names = re.findall(r"\b(\w+)_##NAME\(", src)  # PS_OPS's nine, then PS_ROPE_CACHE's one
    dtypes = re.findall(r"^PS_OPS\((\w+),", src, re.MULTILINE)
    rope_cache = re.findall(r"^PS_ROPE_CACHE\((\w+),", src, re.MULTILINE)
    expect = [f"{o}_{d}" for o in ops_names[:-1] for d in dtypes]
    expect += [f"{ops_names[-1]}_{n}" for n in rope_cache]
    expect += re.findall(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(',
                         src, re.MULTILINE)  # written out: the token mask
    assert sorted(_compile.MODULES["ops"][1]) == sorted(expect)
    assert len(ops_names) == 10 and dtypes == ["bf16", "fp16"] and len(rope_cache) == 4


def entry_points(src: str) -> list[str]:
    """The extern "C" kernels of a CUDA source, instantiated by a PS_ macro or written out."""
    by_macro = re.findall(r"^PS_\w+\((\w+),", src, re.MULTILINE)
    written = re.findall(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(',
                         src, re.MULTILINE)
    return sorted(by_macro + written)


_VARIANT_BLOCK = re.compile(r"^#ifdef PS_VARIANTS\n(.*?)^#endif\n", re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("module", ["attention", "cache"])
def test_module_lists_every_entry_point_of_its_source(module):
    """warmup compiles what MODULES lists: every extern "C" kernel of the source, instantiated
    by a PS_ macro or written out, outside its candidates' #ifdef PS_VARIANTS blocks, and
    nothing else; ON_DEMAND's module lists exactly the candidates of those blocks."""
    filename, listed = _compile.MODULES[module]
    src = _compile.load_source(filename)
    assert sorted(listed) == entry_points(_VARIANT_BLOCK.sub("", src))
    candidates = entry_points("".join(_VARIANT_BLOCK.findall(src)))
    on_demand = [kernels for name, (source, macro, kernels) in _compile.ON_DEMAND.items()
                 if source == filename]
    assert sorted(sum(on_demand, ())) == candidates
    if module == "attention":  # the benchmarks' and tests' candidates, none of them production's
        assert len(candidates) == 6 and not set(candidates) & set(listed)


def test_warmup_loads_production_kernels_only(monkeypatch):
    """An executor's start compiles and loads MODULES' kernels; a candidate's module is built
    only when a launch names one of its kernels."""
    loaded = []
    monkeypatch.setattr(_compile, "get_function",
                        lambda module, kernel, device=None, shared_mem=0: loaded.append(
                            (module, kernel)))
    _compile.warmup(0)
    assert {m for m, _ in loaded} == set(_compile.MODULES) - _compile.LAZY
    candidates = set(_compile.ON_DEMAND["attention_variants"][2])
    assert candidates and not candidates & {k for _, k in loaded}
    assert _compile._module_spec("attention_variants")[2][-1] == "-DPS_VARIANTS"
    assert "-DPS_VARIANTS" not in _compile._module_spec("attention")[2]


def test_the_int4_kernels_load_with_a_quantized_model_not_at_warmup(monkeypatch):
    """quant is LAZY: warmup() skips it, quant.prepare() (the CUDA backend's prepare_model, for
    a model with int4 weights) loads every kernel of it and allocates the split-K workspace."""
    from pagedserve_kernels import quant

    loaded, workspaces = [], []
    monkeypatch.setattr(_compile, "get_function",
                        lambda module, kernel, device=None, shared_mem=0: loaded.append(
                            (module, kernel, device)))
    monkeypatch.setattr(quant, "_workspace", workspaces.append)
    assert "quant" in _compile.LAZY <= set(_compile.MODULES)
    _compile.warmup(0)
    assert not [m for m, _, _ in loaded if m == "quant"]
    loaded.clear()
    quant.prepare(1)
    assert loaded == [("quant", k, torch.device("cuda", 1)) for k in _compile.MODULES["quant"][1]]
    assert workspaces == [torch.device("cuda", 1)]


def test_variants_are_arguments_that_name_their_kernel_and_module():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert attention.decode_kernel(bf16, 128) == ("decode_bf16_hd128", 3)
    assert attention.decode_kernel(fp16, 64) == ("decode_fp16_hd64", 4)
    assert attention.decode_kernel(bf16, 128, "s2") == ("decode_s2_bf16_hd128", 2)
    assert attention.prefill_kernel(fp16, 64, torch.device("cpu"), "mma_sync") == "prefill_fp16_hd64"
    assert attention._few_query_kernel(fp16, 128, False) == "decode_mq_fp16_hd128"
    assert attention._few_query_kernel(fp16, 128, True) == "decode_mqks_fp16_hd128"
    assert attention._module_of("decode_bf16_hd128") == "attention"
    assert attention._module_of("decode_s2_bf16_hd128") == "attention_variants"
    assert attention._module_of("decode_mqks_fp16_hd64") == "attention_variants"
    with pytest.raises(ValueError, match="decode_s2_fp16_hd128"):
        attention.decode_kernel(fp16, 128, "s2")
    with pytest.raises(ValueError, match="decode variant"):
        attention.decode_kernel(bf16, 128, "s3")
    with pytest.raises(ValueError, match="prefill variant"):
        attention.prefill_kernel(bf16, 128, torch.device("cpu"), "fast")
    # The hd64 candidate is bf16 only; the name is refused before any compile.
    with pytest.raises(ValueError, match="no candidate kernel prefill_wg1_fp16_hd64"):
        attention.prefill_kernel(fp16, 64, torch.device("cpu"), "wg1")
    with pytest.raises(ValueError, match="prefill variant"):
        attention.prefill_kernel(bf16, 128, torch.device("cpu"), "pipelined")
    # the pipelined kernel is the default's at hd128, built with the module every start warms
    assert attention._module_of("prefill_wgp_fp16_hd128") == "attention"


def test_pipelined_prefill_is_persistent_over_every_tile_and_head():
    """At most one CTA an SM walks the (tile, head) items, their count bounding the walk (a
    CTA stepping by the grid would otherwise read past the tile list); the other prefill
    kernels take a CTA per (head, tile)."""
    assert attention.prefill_grid("prefill_wgp_bf16_hd128", 32, 264, 132) == ((132, 1, 1), (8448,))
    assert attention.prefill_grid("prefill_wgp_fp16_hd128", 4, 3, 132) == ((12, 1, 1), (12,))
    assert attention.prefill_grid("prefill_wg_bf16_hd128", 32, 264, 132) == ((32, 264, 1), ())
    assert attention.prefill_grid("prefill_bf16_hd64", 8, 5, 132) == ((8, 5, 1), ())


def test_pipelined_prefill_launches_three_warpgroups_with_two_q_buffers():
    """The pipelined kernel adds a producer warpgroup to the wg kernel's two, and a second Q
    buffer to its shared memory (Q and two stages of K and V): persistent, it loads the next
    tile's Q while the consumers finish this one; within an H100's 227 KiB a block."""
    for dtype in ("bf16", "fp16"):
        threads, smem = attention.prefill_launch_shape(f"prefill_wgp_{dtype}_hd128", 128, 2)
        default = attention.prefill_launch_shape(f"prefill_wg_{dtype}_hd128", 128, 2)[1]
        assert threads == 384
        assert smem == default + 128 * 128 * 2 == 1024 + (2 * 128 * 2 + 128 * 4 * 2) * 128
        assert smem <= 227 * 1024


@pytest.mark.parametrize("window,cap", [(0, None), (-3, None), (True, None), (None, 0.0),
                                        (None, -1.0), (None, float("inf")), (None, float("nan"))])
def test_bad_window_or_soft_cap_is_a_value_error_naming_it(window, cap):
    name = "sliding_window" if cap is None else "soft_cap"
    with pytest.raises(ValueError, match=name):
        attention._features(window, cap)


def test_window_and_soft_cap_reach_the_kernels_as_int_and_float():
    assert attention._features(None, None) == (0, 0.0)
    window, cap = attention._features(4096, 50.0)
    assert (int(window), float(cap)) == (4096, 50.0)
    assert window.dtype.name == "int32" and cap.dtype.name == "float32"
    assert int(attention._features(1 << 40, None)[0]) == 2**31 - 1  # past any context


def _kernel_key_ranges(seq_len, tokens, window, block_size, splits, chunk):
    """The decode kernels' split ranges [begin, end) for an entry of `tokens` queries ending at
    seq_len - 1 (decode_impl's arithmetic), and the first key a query of the entry sees."""
    first_lim = seq_len - tokens + 1  # keys the first query sees
    lo = max(0, first_lim - window) if window else 0
    page_lo = lo // block_size
    ranges = []
    for split in range(splits):
        begin = (page_lo + split * chunk) * block_size
        ranges.append((begin, min(seq_len, begin + chunk * block_size)))
    return lo, ranges


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 100, 129, 1000, 5000])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_window_split_plan_covers_every_visible_key_once(block_size, window, tokens):
    """Over contexts from one token to the table's end: the splits laid from the first query's
    window page cover every key some query of the entry sees, each once, each within the page
    list's bound; with a window they span at most its pages."""
    width = 300  # table pages
    for num_seqs in (1, 64, 256):
        span = attention.window_pages(window, tokens, block_size, width)
        splits, chunk = attention.decode_splits(num_seqs, 8, span, block_size, num_sms=132)
        assert chunk <= attention._DECODE_MAX_PAGES and splits * chunk >= span
        if window:
            assert span <= (window + tokens - 2) // block_size + 2
        for seq_len in range(tokens, width * block_size + 1, 131):
            lo, ranges = _kernel_key_ranges(seq_len, tokens, window, block_size, splits, chunk)
            live = [(b, e) for b, e in ranges if b < e]
            assert live[0][0] <= lo and live[-1][1] == seq_len, (seq_len, lo, ranges)
            assert all(e == b2 for (_, e), (b2, _) in zip(live, live[1:]))  # abutting, once
            assert all(e - b <= chunk * block_size for b, e in live)


def test_window_pages():
    assert attention.window_pages(None, 1, 16, 300) == 300
    assert attention.window_pages(1, 1, 16, 300) == 1
    assert attention.window_pages(16, 1, 16, 300) == 2  # 16 keys from a page's second slot on
    assert attention.window_pages(100, 64, 16, 300) == 12  # 163 keys from a last slot on
    assert attention.window_pages(10**9, 1, 16, 300) == 300
    # a window's plan: one split of its pages, where the whole table would take several
    assert attention.decode_splits(256, 8, attention.window_pages(1000, 1, 16, 2048), 16, 132) \
        == (1, 64)
    assert attention.decode_splits(256, 8, 2048, 16, 132)[0] == 2


def test_shared_memory_limit_is_only_raised(monkeypatch):
    """A kernel launched with 100 KiB, then 97, then 100 again keeps the 100 KiB limit (a limit
    set to each new size asked for refused the second 100 KiB launch of bench_kernels'
    policies)."""
    class Fn:
        max_dynamic_shared_size_bytes = 48 * 1024

    fn = Fn()
    monkeypatch.setattr(_compile, "_functions", {("attention", "k", 0): fn})
    monkeypatch.setattr(_compile, "_smem_limit", {})
    for size, limit in ((1024, 48 * 1024), (100 << 10, 100 << 10), (97 << 10, 100 << 10),
                        (100 << 10, 100 << 10), (101 << 10, 101 << 10)):
        assert _compile.get_function("attention", "k", 0, size) is fn
        assert fn.max_dynamic_shared_size_bytes == limit


def test_dequant_threshold_is_where_dequantizing_wins_from_there_up():
    """{rows: (kernel µs, dequantized µs)}: the smallest row count from which the dequantized
    products are faster at every larger count; a win below a loss does not count."""
    from pagedserve_kernels import quant

    times = {128: (10, 20), 256: (20, 19), 384: (30, 31), 512: (40, 30), 1024: (80, 50)}
    assert quant.dequant_threshold(times) == 512
    assert quant.dequant_threshold({128: (2, 1), 2048: (6, 5)}) == 128
    assert quant.dequant_threshold({128: (2, 1), 2048: (5, 6)}) == quant.NEVER
    assert quant.dequant_threshold({}) == quant.NEVER


def test_int4_products_take_the_cta_rows_tuning_measured(monkeypatch):
    """16, 32 or 64 rows a CTA by the row count, from 33 rows the tile tuning measured fastest for
    the product's shape at the largest candidate not above it (64 rows on mma.sync before
    tuning, and for a shape tuning did not time); the grid's third axis counts the row tiles,
    the shared memory the tile's."""
    from pagedserve_kernels import quant

    launched = []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False:
                        launched.append((kernel, grid[2], shared_mem)))
    monkeypatch.setattr(quant, "_splits", lambda kernel, device, m_tiles, n_blocks, k_stages,
                        *_: (1, k_stages))
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_tiles", {})
    k, n = 256, 128
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    packed = quant.repack(qweight, torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)
    rows = (1, 20, 40, 255, 256, 1000)

    def tiles():
        launched.clear()
        for m in rows:
            x = torch.zeros(m, k, dtype=torch.bfloat16)
            quant._kernel_product(x, packed, None, torch.empty(m, n, dtype=torch.bfloat16))
        return launched[:]

    smem = {mt: quant._smem_bytes(mt) for mt in (1, 2, 4, 8)}
    assert tiles() == [("w4a16_bf16_m16", 1, smem[1]), ("w4a16_bf16_m32", 1, smem[2]),
                       ("w4a16_bf16_m64", 1, smem[4]), ("w4a16_bf16_m64", 4, smem[4]),
                       ("w4a16_bf16_m64", 4, smem[4]), ("w4a16_bf16_m64", 16, smem[4])]
    other = (2 * n, k)  # another shape, tuned to other tiles
    quant._tiles[(0, torch.bfloat16)] = {
        (n, k): {64: (64, ""), 128: (64, "wgp"), 256: (128, ""), 768: (128, "wgp")},
        other: {64: (256, "wgt")}}
    assert quant.tile_choice(0) == {(n, k): {64: "m64", 128: "wgp64", 256: "m128",
                                             768: "wgp128"}, other: {64: "wgt256"}}
    assert quant.tile_choice(0, torch.float16) == {}  # tuned per dtype
    assert tiles()[2:] == [("w4a16_bf16_m64", 1, smem[4]),
                           ("w4a16_wgp_bf16_m64", 4, quant._smem_bytes(4, "wgp")),
                           ("w4a16_bf16_m128", 2, smem[8]),
                           ("w4a16_wgp_bf16_m128", 8, quant._smem_bytes(8, "wgp"))]
    assert quant.tile_for(300, 0, torch.bfloat16, other) == (256, "wgt")
    assert quant.tile_for(300, 0, torch.bfloat16, (n, 2 * k)) == quant.NARROW_TILE  # not tuned
    quant._tiles[(0, torch.bfloat16)] = {(n, k): {128: (128, "wgp")}}  # below the smallest
    assert quant.tile_for(33, 0, shape=(n, k)) == (128, "wgp")  # candidate: its tile
    assert quant.tile_for(32, 0, shape=(n, k)) == (32, "")
    assert quant.tile_for(33, 0, torch.float16, (n, k)) == quant.NARROW_TILE
    assert smem[8] == 4 * (256 * 16 + 128 * 64 * 2 + 2 * 2 * 128 * 2)  # Cfg<8>::SMEM
    # WgCfg: 6 / 4 stages, 1 KiB to align; the fp32 output tile [rows][132] fits in the stages
    assert quant._smem_bytes(4, "wgp") == 6 * (256 * 16 + 64 * 128 + 1024) + 1024
    assert quant._smem_bytes(8, "wgp") == 4 * (256 * 16 + 128 * 128 + 1024) + 1024
    assert all(16 * mt * 132 * 4 <= quant._smem_bytes(mt, "wgp") - 1024 for mt in (4, 8))
    # WtCfg<64 / 128 / 256>: 8 / 6 / 4 stages, the fp32 output tile [rows][132] in them, within
    # an H100's 227 KiB a block; 384 threads
    for mt, stages in ((4, 8), (8, 6), (16, 4)):
        smem = quant._smem_bytes(mt, "wgt")
        assert smem == stages * (256 * 16 + 16 * mt * 128 + 1024) + 1024 <= 227 * 1024
        assert 16 * mt * 132 * 4 <= smem - 1024
    assert [quant._threads(name) for name in ("w4a16_bf16_m64", "w4a16_wgp_bf16_m64",
                                              "w4a16_wgt_bf16_m256")] == [256, 256, 384]


def _packed_int4(n: int, k: int):
    from pagedserve_kernels import quant

    return quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                        torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)


def _offline_int4_tuning(monkeypatch, cost, weights_a_shape: int, split_counts=None) -> list:
    """tune_dequant_rows without a GPU: every product records (shape, rows, its tile or
    "dequantized", its K parts), a graph (one shape's weights, each once) takes cost() summed
    over its products, every tile agrees. Returns the shapes whose agreement was checked."""
    from pagedserve_kernels import gemm, quant

    timed: list = []
    checked: list = []

    def kernel(x, w, bias, out, tile=None, splits=None):
        timed.append(((w.n, w.k), x.shape[0], tile, splits))
        return out

    def graph_us(fn):
        timed.clear()
        fn()
        assert len({entry[:2] for entry in timed}) == 1 and len(timed) == weights_a_shape
        return sum(cost(*entry) for entry in timed)

    monkeypatch.setattr(gemm, "graph_us", graph_us)
    monkeypatch.setattr(quant, "_kernel_product", kernel)
    monkeypatch.setattr(quant, "_dequantized_product", lambda x, w, bias, out, scratch: kernel(
        x, w, bias, out, "dequantized"))
    monkeypatch.setattr(quant, "_agreeing_tiles", lambda w, dev, tiles: checked.append(
        [(p.n, p.k) for p in w]) or list(tiles))
    monkeypatch.setattr(quant, "_last_wave_us", lambda x, group, out, tile, dev, form: None)
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_tiles", {})
    monkeypatch.setattr(quant, "_last_waves", {})
    monkeypatch.setattr(quant, "_split_counts", split_counts or {})
    monkeypatch.setattr(quant, "_dequant_rows", {})
    monkeypatch.setattr(quant, "_scratch", {(0, torch.bfloat16): torch.empty(512 * 256)})
    monkeypatch.setattr(torch, "randn", lambda *size, **kw: torch.zeros(*size))
    monkeypatch.setattr(torch, "empty", lambda *size, **kw: torch.zeros(*size))
    return checked


def test_int4_tuning_takes_each_shapes_fastest_tile_and_threshold(monkeypatch):
    """tune_dequant_rows times each shape on its own, all the weights of a shape (several
    layers') in one graph, at the row counts given above 32 and where it times dequantizing,
    and each shape keeps its own fastest tile at every one of them and its own dequantizing
    threshold; the tiles' agreement is checked on one weight of each shape."""
    from pagedserve_kernels import quant

    narrow, wide = (128, 256), (512, 256)  # (N, K); three layers of each, interleaved
    weights = [_packed_int4(*shape) for _ in range(3) for shape in (narrow, wide)]

    def cost(shape, rows, way, splits):
        # narrow: the 64-row wgt tile wins everywhere; wide: the 256-row one from 256 rows, and
        # dequantizing from 1,024; a graph's time is its products' sum
        if way == "dequantized":
            return rows * (0.5 if shape == wide and rows >= 1024 else 2.0)
        if way == (64, "wgt"):
            return rows * (0.8 if shape == narrow else 1.2)
        if way == (256, "wgt"):
            return rows * (1.1 if shape == narrow else (0.9 if rows >= 256 else 1.3))
        return float(rows)

    checked = _offline_int4_tuning(monkeypatch, cost, 3)
    tiles = ((64, ""), (64, "wgt"), (256, "wgt"))
    tuned = quant.tune_dequant_rows(weights, "cuda", tiles, (16, 160, 96))
    # the given row counts above 32, with those where dequantizing is timed
    candidates = sorted({96, 160} | set(quant.DEQUANT_CANDIDATES))
    assert sorted(tuned) == [narrow, wide]
    assert quant.tile_choice(0)[narrow] == {rows: "wgt64" for rows in candidates}
    assert quant.tile_choice(0)[wide] == {rows: "m64" if rows < 256 else "wgt256"
                                          for rows in candidates}
    assert tuned[narrow][0] == quant.NEVER and tuned[wide][0] == 1024
    assert tuned[wide][1][2048] == (0.9 * 2048, 0.5 * 2048)  # a product's µs, not the graph's
    assert quant._dequant_rows == {(0, *narrow): quant.NEVER, (0, *wide): 1024}
    assert quant.tile_for(300, 0, torch.bfloat16, wide) == (256, "wgt")
    assert quant.tile_for(300, 0, torch.bfloat16, narrow) == (64, "wgt")
    assert checked == [[narrow, wide]]


def test_int4_tuning_splits_the_last_wave_off_where_that_is_faster(monkeypatch):
    """Where the chosen tile has a partial last wave to split off (_last_wave_us gives its time
    in each of TUNED_WAVE_FORMS, else None), tuning keeps the fastest form at the row counts
    where it is faster than the whole launch by LAST_WAVE_GAIN; tile_choice marks them "+parts"
    or "+stream", and a product takes that form at the row counts tile_for takes the tile from.
    Only the tuned forms are timed ("stream" waits for a GPU's verdict)."""
    from pagedserve_kernels import quant

    monkeypatch.setattr(quant, "TUNED_WAVE_FORMS", quant.WAVE_FORMS)

    shape = (512, 256)
    weights = [_packed_int4(*shape) for _ in range(2)]
    _offline_int4_tuning(monkeypatch, lambda shape, rows, tile, splits: float(rows), 2)
    # K parts faster at 256 rows, the stream-K rest at 384 (parts there too, less), both
    # slower at 512, neither by LAST_WAVE_GAIN at 1,024, none elsewhere
    split_us = {(256, "parts"): 100.0, (256, "stream"): 200.0, (384, "parts"): 300.0,
                (384, "stream"): 250.0, (512, "parts"): 2000.0, (512, "stream"): 900.0,
                (1024, "stream"): 0.99 * 1024}
    monkeypatch.setattr(quant, "_last_wave_us", lambda x, group, out, tile, dev, form:
                        split_us.get((x.shape[0], form)))
    tuned = quant.tune_dequant_rows(weights, "cuda", ((256, "wgt"),), (256, 384, 512))
    assert quant._last_waves[(0, torch.bfloat16)][shape] == {
        rows: {256: "parts", 384: "stream"}.get(rows)
        for rows in sorted({256, 384, 512} | set(quant.DEQUANT_CANDIDATES))}
    assert tuned[shape][1][256][0] == 100.0  # the kernel's time is the split launch's
    assert quant.tile_choice(0)[shape][256] == "wgt256+parts"
    assert quant.tile_choice(0)[shape][384] == "wgt256+stream"
    assert quant.tile_choice(0)[shape][512] == "wgt256"
    assert quant._last_wave_form(300, 0, torch.bfloat16, shape) == "parts"
    assert quant._last_wave_form(400, 0, torch.bfloat16, shape) == "stream"
    assert quant._last_wave_form(600, 0, torch.bfloat16, shape) is None
    assert quant._last_wave_form(300, 0, torch.bfloat16, (128, 256)) is None  # not tuned


def _wave_split_launches(monkeypatch):
    """quant's launches recorded as (kernel, grid, cluster, args) on a device of 132 SMs holding
    one producer-fed CTA each (32 four-CTA clusters: four SMs left idle by the GPCs' sizes), and
    the rest of a split last wave given rest_parts[0] K parts; returns (launched, the _splits
    calls, rest_parts, the split-K workspace, its counters, the stream-K workspace)."""
    from pagedserve_kernels import quant

    launched = []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False, cluster=None: launched.append(
                            (kernel, grid, cluster, args)))
    monkeypatch.setattr(quant._compile, "tensor_map_2d", lambda *a: "map")
    clusters = {"w4a16_wgq_bf16_m256": 32}  # four of 132 SMs left idle by the GPCs' sizes
    monkeypatch.setattr(quant._compile, "max_active_clusters",
                        lambda module, kernel, device, block, smem, cluster: clusters.get(kernel))
    ws, counters, stream_ws = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    monkeypatch.setattr(quant, "_workspace", lambda device: (ws, counters))
    monkeypatch.setattr(quant, "_stream_k_workspace", lambda device: stream_ws)
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_slots", {})
    monkeypatch.setattr(quant, "_sm_count", lambda device: 132)
    monkeypatch.setattr(quant, "_resident_ctas", lambda kernel, device: 1)
    chosen = []
    real_splits = quant._splits
    rest_parts = [2]

    def splits(kernel, device, m_tiles, n_blocks, k_stages, partial_floats, tile_rows,
               forced=None):
        chosen.append((kernel, m_tiles, n_blocks, partial_floats))
        if forced is not None:
            return forced, k_stages // forced
        if "_wgt_" in kernel and n_blocks < 100:  # the rest
            return rest_parts[0], k_stages // rest_parts[0]
        return real_splits(kernel, device, m_tiles, n_blocks, k_stages, partial_floats,
                           tile_rows, 1)

    monkeypatch.setattr(quant, "_splits", splits)
    return launched, chosen, rest_parts, ws, counters, stream_ws


def test_a_split_last_wave_launches_the_whole_waves_then_the_rest_with_k_in_parts(monkeypatch):
    """last_wave: a tile with K whole over more tiles than the device runs at once (a multicast
    tile's clusters as the driver counts them), in no whole number of waves, launches the column
    blocks of its whole waves (a multiple of its cluster) as it would, then the wgt tile of its
    rows over the rest with the weights, scales, zero points, bias and output from the first of
    them on (N counted from there, Np kept: the scales' rows' stride), K in split_k_choice's
    parts, partials as wide as that launch; with whole waves, K already in parts, the rest left
    with K whole, or a family without the split, one launch as before."""
    from pagedserve_kernels import quant

    launched, chosen, rest_parts, ws, counters, _ = _wave_split_launches(monkeypatch)
    n, k, m = 28600, 512, 512  # 224 column blocks (Np 28,672) x 2 row tiles of 256: 448 tiles
    assert quant.head_blocks("w4a16_wgq_bf16_m256", 0, 2, 224) == 192  # 3 waves of 128 CTAs
    assert quant.head_blocks("w4a16_wgm_bf16_m256", 0, 2, 224) == 198  # 396: 3 waves of 132
    assert quant.head_blocks("w4a16_wgt_bf16_m256", 0, 1, 264) == 0  # two whole waves
    assert quant.head_blocks("w4a16_wgt_bf16_m256", 0, 1, 100) == 0  # not one wave
    for zeros, bias in ((True, True), (False, False)):
        packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                              torch.ones(k // 128, n, dtype=torch.bfloat16),
                              torch.full((k // 128, n), 8, dtype=torch.uint8) if zeros else None,
                              128, None)
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        b = torch.zeros(n, dtype=torch.bfloat16) if bias else None
        launched.clear()
        quant._kernel_product(x, packed, b, out, (256, "wgq"), None, "parts")
        (head, head_grid, head_cluster, a), (tail, tail_grid, tail_cluster, t) = launched
        assert (head, head_grid, head_cluster) == ("w4a16_wgq_bf16_m256", (192, 1, 2), (4, 1, 1))
        assert (tail, tail_grid, tail_cluster) == ("w4a16_wgt_bf16_m256", (32, 2, 2), None)
        assert chosen[-1] == ("w4a16_wgt_bf16_m256", 2, 32, m * 32 * 128)
        col = 192 * 128
        z = packed.zeros.data_ptr() if zeros else 0
        bp = b.data_ptr() if bias else 0
        assert a[:8] == (out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                         packed.qweight.data_ptr(), packed.scales.data_ptr(), z, bp)
        assert a[8:10] == (0, 0) and t[8:10] == (ws.data_ptr(), counters.data_ptr())
        assert t[:8] == (out.data_ptr() + 2 * col, out.stride(0), x.data_ptr(), x.stride(0),
                         packed.qweight[col // 32].data_ptr(), packed.scales.data_ptr() + 2 * col,
                         z and z + 2 * col, bp and bp + 2 * col)
        assert (a[11], t[11]) == (n, n - col)  # N from the launch's first column
        assert a[14] == t[14] == 28672  # Np: the scales' rows' stride
        assert t[16] == (k // 64) // 2  # stages a part
    # the same without last_wave: one launch of the whole
    launched.clear()
    quant._kernel_product(x, packed, b, out, (256, "wgq"), None, False)
    assert [entry[:3] for entry in launched] == [("w4a16_wgq_bf16_m256", (224, 1, 2), (4, 1, 1))]
    # K already in parts, or a family without the split: one launch; nor where the rest would
    # keep K whole
    for tile, parts in (((256, "wgq"), 2), ((256, "wgs"), None), ((64, ""), None)):
        launched.clear()
        quant._kernel_product(x, packed, b, out, tile, parts, "parts")
        assert len(launched) == 1
    rest_parts[0] = 1
    launched.clear()
    quant._kernel_product(x, packed, b, out, (256, "wgt"), None, "parts")
    assert [entry[:2] for entry in launched] == [("w4a16_wgt_bf16_m256", (224, 1, 2))]
    assert quant.wave_split("w4a16_wgt_bf16_m256", 0, m, 2, packed) is None
    # only the wgt and wgs tiles are launched from past column 0
    with pytest.raises(AssertionError):
        quant._launch_product(x, packed, b, out, "w4a16_wgq_bf16_m256", 16, 2, 1, 8, 4, 4)


def test_a_stream_k_rest_launches_the_wgs_tile_over_the_rests_columns(monkeypatch):
    """last_wave "stream": the column blocks of the whole waves launched as for "parts", then the
    wgs tile of the same rows over the rest: one CTA an SM up to the rest's (row tile, column
    block, K stage) units, the stream-K workspace and the arrival counters, the pointers and N
    from the rest's first column (Np kept: the scales' rows' stride), its last argument the
    rest's column blocks (a whole product's wgs launch: all of its own); one launch where the
    rest has more tiles than there are arrival counters."""
    from pagedserve_kernels import quant

    launched, _, _, _, counters, stream_ws = _wave_split_launches(monkeypatch)
    n, k, m = 28600, 512, 512  # 224 column blocks (Np 28,672) x 2 row tiles of 256: 448 tiles
    packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                          torch.ones(k // 128, n, dtype=torch.bfloat16),
                          torch.full((k // 128, n), 8, dtype=torch.uint8), 128, None)
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    b = torch.zeros(n, dtype=torch.bfloat16)
    for family, head in (("wgt", 198), ("wgm", 198), ("wgq", 192)):
        launched.clear()
        quant._kernel_product(x, packed, b, out, (256, family), None, "stream")
        (first, first_grid, _, a), (rest, rest_grid, rest_cluster, t) = launched
        blocks, col = 224 - head, head * 128
        assert (first, first_grid) == (f"w4a16_{family}_bf16_m256", (head, 1, 2))
        assert a[16] == k // 64  # K whole
        assert (rest, rest_grid, rest_cluster) == ("w4a16_wgs_bf16_m256", (132, 1, 1), None)
        assert t[:10] == (out.data_ptr() + 2 * col, out.stride(0), x.data_ptr(), x.stride(0),
                          packed.qweight[col // 32].data_ptr(), packed.scales.data_ptr() + 2 * col,
                          packed.zeros.data_ptr() + 2 * col, b.data_ptr() + 2 * col,
                          stream_ws.data_ptr(), counters.data_ptr())
        assert (t[11], t[14], t[16]) == (n - col, 28672, blocks)
    # K of one stage: the rest's 26 blocks x 2 row tiles are 52 units, so 52 CTAs
    launched.clear()
    short = quant.repack(torch.zeros(64 // 8, n, dtype=torch.int32),
                         torch.ones(1, n, dtype=torch.bfloat16), None, 64, None)
    quant._kernel_product(torch.zeros(m, 64, dtype=torch.bfloat16), short, None, out,
                          (256, "wgt"), None, "stream")
    assert launched[1][1] == (2 * 26, 1, 1)
    # a whole product on the wgs tile: all its column blocks, from column 0
    launched.clear()
    quant._kernel_product(x, packed, b, out, (256, "wgs"))
    (kernel, grid, _, t), = launched
    assert (kernel, grid, t[0], t[11], t[16]) == ("w4a16_wgs_bf16_m256", (132, 1, 1),
                                                  out.data_ptr(), n, 224)
    monkeypatch.setattr(quant, "MAX_SPLIT_TILES", 2 * 26 - 1)
    assert quant.wave_split("w4a16_wgm_bf16_m256", 0, m, 2, packed, "stream") is None
    launched.clear()
    quant._kernel_product(x, packed, b, out, (256, "wgm"), None, "stream")
    assert [entry[:2] for entry in launched] == [("w4a16_wgm_bf16_m256", (224, 1, 2))]


def test_tuning_times_a_split_last_wave_only_where_it_agrees(monkeypatch, caplog):
    """_last_wave_us: None for a tile with K in parts or no wave to split (wave_split's None);
    else the two launches' product checked against the whole one on the shape's first weight
    (one bf16 rounding of the largest value) and timed over every weight of the shape in one
    graph, or None, logged, where it disagrees."""
    from pagedserve_kernels import gemm, quant

    weights = [_packed_int4(512, 256) for _ in range(3)]
    x, out = torch.ones(300, 256), torch.zeros(300, 512)
    shape = [("w4a16_wgt_bf16_m256", 64, 2, 1, 4)]
    split = [(192, "w4a16_wgt_bf16_m256", 2, 2)]
    monkeypatch.setattr(quant, "launch_shape", lambda *a, **kw: shape[0])
    monkeypatch.setattr(quant, "wave_split", lambda *a: split[0])
    monkeypatch.setattr(gemm, "graph_us", lambda fn: fn() and 30.0)
    off = [1.0]
    products = []

    def product(x, w, bias, out, tile, splits, last_wave):
        products.append((w, last_wave))
        return out.fill_(off[0] if last_wave else 1.0)

    monkeypatch.setattr(quant, "_kernel_product", product)
    dev = torch.device("cpu")
    # 30 µs for three products
    assert quant._last_wave_us(x, weights, out, (256, "wgt"), dev, "parts") == 10.0
    assert products[2:] == [(w, "parts") for w in weights]  # the graph: every weight, split
    off[0] = 1.0 + 2.0 ** -6  # past one rounding: disagrees
    with caplog.at_level("WARNING", logger="pagedserve_kernels.quant"):
        assert quant._last_wave_us(x, weights, out, (256, "wgt"), dev, "parts") is None
    assert "last wave split (parts) disagrees" in caplog.text
    split[0] = None
    assert quant._last_wave_us(x, weights, out, (256, "wgt"), dev, "parts") is None
    shape[0] = ("w4a16_wgt_bf16_m256", 64, 2, 2, 2)  # K already in parts
    split[0] = (192, "w4a16_wgt_bf16_m256", 2, 2)
    assert quant._last_wave_us(x, weights, out, (256, "wgt"), dev, "parts") is None


def test_int4_tuning_takes_each_shapes_fastest_k_parts_for_the_small_tiles(monkeypatch):
    """At each of SMALL_TUNE_ROWS' row counts (1, 4 and 16 for the 16-row tile, 32 for the
    32-row one) tune_dequant_rows times the tile with K in each of SPLIT_CANDIDATES parts and
    in split_k_choice's (None), a shape's weights in one graph; each count keeps its fastest
    for the shape, the model's on a tie (no entry), and the row counts above the one before it
    then launch that count; tile_choice names it for the logs."""
    from pagedserve_kernels import quant

    narrow, wide = (128, 256), (512, 256)
    weights = [_packed_int4(*shape) for _ in range(2) for shape in (narrow, wide)]

    def cost(shape, rows, tile, splits):
        if tile is not None or rows > 32:
            return 1.0
        if shape == narrow:  # 2 parts at one row, 8 at 16; at 4 and 32 the model and 4 tie
            best = {1: 2, 16: 8}.get(rows)
            return 1.0 if splits == best else {4: 2.0, None: 2.0}.get(splits, 3.0)
        return 1.0 if splits == 4 else 2.0  # wide: 4 parts at every count

    _offline_int4_tuning(monkeypatch, cost, 2, {(0, torch.bfloat16): {(64, 64): {16: 2}}})
    quant.tune_dequant_rows(weights, "cuda", ((64, ""),), (64,))
    assert quant._split_counts == {(0, torch.bfloat16): {
        (64, 64): {16: 2}, narrow: {1: 2, 16: 8}, wide: {1: 4, 4: 4, 16: 4, 32: 4}}}
    assert quant.tile_choice(0)[narrow] == {1: "m16/k2", 16: "m16/k8", **{
        rows: "m64" for rows in sorted({64} | set(quant.DEQUANT_CANDIDATES))}}
    forced = []
    monkeypatch.setattr(quant, "_splits", lambda kernel, device, m_tiles, n_blocks, k_stages,
                        partial, tile_rows, count=None: forced.append(count) or (1, k_stages))
    for rows in (1, 2, 4, 5, 16, 17, 32, 33):
        quant.launch_shape(rows, weights[0], "cuda", torch.bfloat16)  # narrow
        quant.launch_shape(rows, weights[1], "cuda", torch.bfloat16)  # wide
    assert forced == [2, 4, None, 4, None, 4, 8, 4, 8, 4, None, 4, None, 4, None, None]
    quant.launch_shape(16, weights[0], "cuda", torch.bfloat16, None, 2)  # bench_quant's --splits
    quant.launch_shape(16, weights[0], "cuda", torch.float16)  # tuned per dtype
    assert forced[-2:] == [2, None]


def test_int4_tuning_drops_a_tile_whose_products_disagree(monkeypatch, caplog):
    """A tile whose output differs from the 64-row mma.sync kernel's beyond one bf16 rounding is
    logged and never offered to tuning; the wgmma tiles only where the module is built for
    sm_90a."""
    from pagedserve_kernels import quant

    def product(x, packed, bias, out, tile=None):
        out.copy_(x[:, :packed.n] * (1.5 if tile == (128, "wgp") else 1.0))  # one wrong tile
        if tile == (64, "wgp"):
            out[0, 0] += out[0, 0].abs() * 2.0 ** -9  # within one rounding: agrees
        return out

    monkeypatch.setattr(quant, "_kernel_product", product)
    k, n = 256, 128
    packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                          torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)
    monkeypatch.setattr(quant._compile, "arch_used", lambda device, module: "-arch=sm_90a")
    with caplog.at_level("WARNING", logger="pagedserve_kernels.quant"):
        assert quant._agreeing_tiles([packed], torch.device("cpu")) == [
            (64, ""), (128, ""), (64, "wgp"), (64, "wgt"), (128, "wgt"), (256, "wgt"),
            (64, "wgs"), (128, "wgs"), (256, "wgs"), (64, "wgw"), (128, "wgw"),
            (128, "wgm"), (256, "wgm"), (128, "wgq"), (256, "wgq")]
    assert "w4a16_wgp_bf16_m128 disagrees with w4a16_bf16_m64" in caplog.text
    monkeypatch.setattr(quant._compile, "arch_used", lambda device, module: "-arch=sm_89")
    assert quant._agreeing_tiles([packed], torch.device("cpu")) == [(64, ""), (128, "")]


def _launch_of(launched: list):
    """product(m, n, k, tile): launches a zero product of m rows on an [n, k] weight in `tile`
    (with _compile.launch recording into `launched`) and returns what the launch recorded."""
    from pagedserve_kernels import quant

    def product(m, n, k, tile):
        packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                              torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)
        launched.clear()
        quant._kernel_product(torch.zeros(m, k, dtype=torch.bfloat16), packed, None,
                              torch.empty(m, n, dtype=torch.bfloat16), tile)
        return launched[0]

    return product


def test_stream_k_tiles_launch_one_cta_an_sm_with_their_parts(monkeypatch):
    """A "wgs" tile launches min(SMs, tiles x K stages) CTAs of the wgt tile's 384 threads and
    shared memory, with the stream-K parts and the arrival counters; with more tiles than
    counters, the same tile without stream-K (wgt, split K as usual)."""
    from pagedserve_kernels import quant

    launched = []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False:
                        launched.append((kernel, grid, block[0], shared_mem, args[8], args[9])))
    parts, (ws, counters) = torch.zeros(1), (torch.zeros(1), torch.zeros(1))
    monkeypatch.setattr(quant, "_stream_k_workspace", lambda device: parts)
    monkeypatch.setattr(quant, "_workspace", lambda device: (ws, counters))
    monkeypatch.setattr(quant, "_sm_count", lambda device: 132)
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_splits", lambda kernel, device, m_tiles, n_blocks, k_stages,
                        *_: (1, k_stages))
    product = _launch_of(launched)

    smem = quant._smem_bytes(8, "wgs")
    assert smem == quant._smem_bytes(8, "wgt")
    # 3 row tiles x 4 column blocks x 4 stages: fewer units than SMs
    assert product(300, 512, 256, (128, "wgs")) == (
        "w4a16_wgs_bf16_m128", (48, 1, 1), 384, smem, parts.data_ptr(), counters.data_ptr())
    # Llama's gate/up at 256 rows: 224 tiles of 64 stages over 132 CTAs
    assert product(256, 28672, 4096, (256, "wgs"))[:3] == ("w4a16_wgs_bf16_m256", (132, 1, 1),
                                                           384)
    monkeypatch.setattr(quant, "MAX_SPLIT_TILES", 8)  # 12 tiles: no counter for each
    assert product(300, 512, 256, (128, "wgs")) == ("w4a16_wgt_bf16_m128", (4, 1, 3), 384,
                                                    smem, 0, 0)


def test_wide_tiles_launch_256_columns_a_cta(monkeypatch):
    """A "wgw" tile: ceil(Np / 256) column blocks (a last half block past Np included), the wgt
    tile's 384 threads, WtCfg<rows, 256>'s shared memory (8 stages of 256 columns' weights,
    scales and zeros plus x, 1 KiB to align; its fp32 output tile [rows][260] within them),
    from the "quant" module as every product; its split-K model counts 256-column blocks, and
    tuning offers it."""
    from pagedserve_kernels import quant

    launched, split_args = [], []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False:
                        launched.append((module, kernel, grid, block[0], shared_mem)))
    monkeypatch.setattr(quant, "_workspace", lambda device: (torch.zeros(1), torch.zeros(1)))
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_splits", lambda kernel, device, m_tiles, n_blocks, k_stages,
                        *_: split_args.append((kernel, m_tiles, n_blocks)) or (1, k_stages))
    product = _launch_of(launched)

    for mt in (4, 8):
        smem = quant._smem_bytes(mt, "wgw")
        assert smem == 8 * (256 * 32 + 16 * mt * 128 + 2048) + 1024 <= 227 * 1024
        assert 16 * mt * 260 * 4 <= smem - 1024
    assert product(256, 28672, 4096, (128, "wgw")) == (
        "quant", "w4a16_wgw_bf16_m128", (112, 1, 2), 384, quant._smem_bytes(8, "wgw"))
    assert split_args[-1] == ("w4a16_wgw_bf16_m128", 2, 112)
    # N = 136 pads to 256: one block; 384 to 3 blocks of 128, so 2 of 256 (the last half past)
    assert product(40, 136, 256, (64, "wgw"))[1:3] == ("w4a16_wgw_bf16_m64", (1, 1, 1))
    assert product(130, 264, 256, (64, "wgw"))[2] == (2, 1, 3)
    assert product(130, 264, 256, (64, "wgt"))[:3] == ("quant", "w4a16_wgt_bf16_m64", (3, 1, 3))
    assert {(64, "wgw"), (128, "wgw")} <= set(quant.TUNED_TILES)

    def kernels(module):
        return (_compile.MODULES[module][1] if module in _compile.MODULES
                else _compile.ON_DEMAND[module][2])

    # every tile's kernels in the module its launches name; the tuned ones in quant's own
    assert all(quant._kernel_name(dtype, *tile) in kernels(quant._module(tile[1]))
               for tile in quant.TUNED_TILES + quant.CANDIDATE_TILES
               for dtype in (torch.bfloat16, torch.float16))
    assert all(quant._module(family) == "quant" for _, family in quant.TUNED_TILES)


def test_multicast_tiles_launch_as_clusters_of_column_blocks_with_x_map(monkeypatch):
    """A "wgm" candidate: from the cluster module as clusters of (2, 1, 1) over an even count
    of column blocks (an odd one gains a block past Np, where the kernel reads zero weights and
    stores nothing), with the wgt tile's 384 threads and shared memory, and x's tensor map (its
    rows and K, half a row tile by 64 columns a box) by value after the wgt tile's arguments;
    "wgq" the same in clusters of 4; both built in quant's own module and offered to tuning."""
    from pagedserve_kernels import quant

    launched, maps = [], []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False, cluster=None: launched.append(
                            (module, kernel, grid, block[0], shared_mem, cluster, args)))
    monkeypatch.setattr(quant._compile, "tensor_map_2d", lambda *a: maps.append(a) or "map")
    monkeypatch.setattr(quant, "_workspace", lambda device: (torch.zeros(1), torch.zeros(1)))
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_splits", lambda kernel, device, m_tiles, n_blocks, k_stages,
                        *_: (1, k_stages))
    product = _launch_of(launched)

    module, kernel, grid, threads, smem, cluster, args = product(256, 28672, 4096, (256, "wgm"))
    assert (module, kernel, grid, threads, smem, cluster) == (
        "quant", "w4a16_wgm_bf16_m256", (224, 1, 1), 384,
        quant._smem_bytes(16, "wgt"), (2, 1, 1))
    assert len(args) == 18 and args[-1] == "map"  # the wgt tile's 17, then the map
    assert maps[-1][1:] == (torch.bfloat16, 256, 4096, 4096, 128, 64)
    assert maps[-1][0] == args[2]  # x's address
    # N = 264 pads to 384: 3 blocks of 128, so 4; 130 rows in two tiles of 128
    assert product(130, 264, 256, (128, "wgm"))[1:3] == ("w4a16_wgm_bf16_m128", (4, 1, 2))
    assert maps[-1][1:] == (torch.bfloat16, 130, 256, 256, 64, 64)
    assert product(130, 264, 256, (128, "wgt"))[2] == (3, 1, 2)
    # clusters of 4 ("wgq"): a quarter of a row tile a box, the column blocks a multiple of 4
    module, kernel, grid, threads, smem, cluster, args = product(256, 28672, 4096, (256, "wgq"))
    assert (module, kernel, grid, cluster) == ("quant", "w4a16_wgq_bf16_m256",
                                               (224, 1, 1), (4, 1, 1))
    assert maps[-1][1:] == (torch.bfloat16, 256, 4096, 4096, 64, 64)
    assert product(130, 264, 256, (128, "wgq"))[2] == (4, 1, 2)
    assert product(130, 1152, 256, (128, "wgq"))[2] == (12, 1, 2)  # 9 blocks
    assert maps[-1][1:] == (torch.bfloat16, 130, 256, 256, 32, 64)
    assert set(quant.MULTICAST_TILES) <= set(quant.TUNED_TILES)


def test_a_forced_split_count_keeps_within_k_and_the_workspace(monkeypatch):
    """bench_quant's --splits: `splits` replaces split_k_choice's count, lowered to what K (a
    split covers at least _MIN_SPLIT_STAGES stages) and the workspace allow, and the grid's
    second axis carries it; None keeps the model's choice."""
    from pagedserve_kernels import quant

    launched = []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False:
                        launched.append((grid[1], args[-1])))
    monkeypatch.setattr(quant, "_workspace", lambda device: (torch.zeros(1), torch.zeros(1)))
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_tiles", {})
    monkeypatch.setattr(quant, "_sm_count", lambda device: 132)
    monkeypatch.setattr(quant, "_resident_ctas", lambda kernel, device: 3)
    k, n = 4096, 4096  # 64 stages, 32 column blocks
    packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                          torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)
    x, out = torch.zeros(16, k, dtype=torch.bfloat16), torch.empty(16, n, dtype=torch.bfloat16)
    for forced, expected in ((None, (11, 6)), (1, (1, 64)), (4, (4, 16)), (5, (5, 13)),
                             (16, (16, 4)), (64, (16, 4))):
        launched.clear()
        quant._kernel_product(x, packed, None, out, splits=forced)
        assert launched == [expected], forced
        assert quant.launch_shape(16, packed, x.device, x.dtype, None, forced)[3:] == expected


def test_split_k_avoids_spilling_a_few_blocks_into_another_wave():
    """Llama-3-8B's products at one row tile on 396 slots (132 SMs x 3): qkv, o and down fill
    one wave; gate/up (224 column tiles) takes 5 splits of 13 stages (3 short waves), not the 2
    whose 448 blocks spill 52 into a second wave of 32 stages."""
    from pagedserve_kernels.quant import split_k_choice

    assert split_k_choice(48, 64, 396, 16) == (8, 8)  # qkv: 384 blocks
    assert split_k_choice(32, 64, 396, 16) == (11, 6)  # o: 6 stages each, 352 blocks
    assert split_k_choice(32, 224, 396, 56) == (12, 19)  # down
    assert split_k_choice(224, 64, 396, 16) == (5, 13)  # gate/up
    assert split_k_choice(224, 64, 396, 1) == (1, 64)  # the workspace's bound
    # fp32 partials weigh on every split: 64 rows a tile (2 stages' bytes) keep 8 splits of o
    assert split_k_choice(32, 64, 264, 16, partial_stages=8.0)[0] <= 8
    for tiles, k, slots, most in ((48, 64, 264, 16), (224, 64, 132, 16), (7, 224, 396, 56)):
        splits, per = split_k_choice(tiles, k, slots, most)
        assert 1 <= splits <= most and splits * per >= k > (splits - 1) * per


def test_programmatic_launch_structures_have_cuda_h_layout():
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out (on
    x86-64): a field out of place launches another grid or drops the attribute silently."""
    import ctypes
    import struct

    attr, config = _compile._LaunchAttribute, _compile._LaunchConfig
    assert ctypes.sizeof(attr) == 72 and attr.value.offset == 8
    assert ctypes.sizeof(config) == 56
    assert (config.shared_mem.offset, config.stream.offset, config.attrs.offset,
            config.num_attrs.offset) == (24, 32, 40, 48)
    assert _compile._PROGRAMMATIC_STREAM_SERIALIZATION == 6
    # a cluster attribute as cuda.h lays it out: the id, then x, y, z as 32-bit values from 8
    cluster = attr(id=_compile._CLUSTER_DIMENSION, value=(1, 8, 1))
    assert struct.unpack_from("<i4xIII", ctypes.string_at(ctypes.addressof(cluster), 20)) == (
        4, 1, 8, 1)


def test_cluster_tiles_launch_as_clusters_of_their_k_parts(monkeypatch):
    """The cluster candidates (quant.CLUSTER_TILES) launch from their own module as clusters of
    (1, splits, 1), at most MAX_CLUSTER parts, without the global workspace; the plain tiles
    launch with no cluster."""
    from pagedserve_kernels import quant

    launched, workspace = [], []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False, cluster=None: launched.append(
                            (module, kernel, grid, cluster)))
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_programmatic", {})
    monkeypatch.setattr(quant, "_workspace", lambda device: workspace.append(device) or (
        torch.zeros(1), torch.zeros(1)))
    def splits_of(kernel, device, m_tiles, n_blocks, k_stages, partial, tile_rows, forced=None):
        count = forced or 4  # the model's count: 4
        return count, -(-k_stages // count)

    monkeypatch.setattr(quant, "_splits", splits_of)
    k, n = 4096, 256
    packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                          torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)
    for tile, splits in (((16, "cl"), None), ((32, "cl"), 16), ((16, ""), 16)):
        m = tile[0]
        quant._kernel_product(torch.zeros(m, k, dtype=torch.bfloat16), packed, None,
                              torch.empty(m, n, dtype=torch.bfloat16), tile, splits)
    assert launched == [
        (quant.CLUSTER_MODULE, "w4a16_cl_bf16_m16", (2, 4, 1), (1, 4, 1)),
        (quant.CLUSTER_MODULE, "w4a16_cl_bf16_m32", (2, 8, 1), (1, 8, 1)),
        ("quant", "w4a16_bf16_m16", (2, 16, 1), None)]
    assert len(workspace) == 1  # the plain tile's partials only
    assert set(_compile.ON_DEMAND[quant.CLUSTER_MODULE][2]) == {
        quant._kernel_name(dtype, rows, family)
        for rows, family in quant.CLUSTER_TILES for dtype in (torch.bfloat16, torch.float16)}


def test_kernel_arguments_keep_each_c_type():
    import ctypes

    import numpy as np

    tmap = _compile.TensorMap.aligned()
    values = _compile.kernel_arguments((2**40 + 16, np.int64(-3), np.int32(7), np.float32(0.5), 0,
                                        tmap))
    assert [type(v) for v in values] == [ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32,
                                         ctypes.c_float, ctypes.c_uint64, _compile.TensorMap]
    assert [v.value for v in values[:5]] == [2**40 + 16, -3, 7, 0.5, 0]
    # a tensor map goes by value from its own 64-byte aligned 128 bytes, as cuda.h's CUtensorMap
    assert values[5] is tmap and ctypes.sizeof(tmap) == 128 and ctypes.addressof(tmap) % 64 == 0
    with pytest.raises(TypeError, match="float"):
        _compile.kernel_arguments((1.5,))


def test_products_launch_programmatically_only_where_set_and_within_the_row_range(monkeypatch,
                                                                                   caplog):
    """set_programmatic turns the launches on only where the device can and the bit check
    passes (a refused launch or other bits leave them plain, with a warning); then products of
    PROGRAMMATIC_MIN_ROWS to PROGRAMMATIC_ROWS rows launch programmatically, others plainly."""
    from pagedserve_kernels import quant

    launched = []
    monkeypatch.setattr(quant._compile, "launch",
                        lambda module, kernel, device, grid, block, args, shared_mem=0,
                        programmatic=False: launched.append(programmatic))
    monkeypatch.setattr(quant, "_index", lambda device: 0)
    monkeypatch.setattr(quant, "_programmatic", {})
    monkeypatch.setattr(quant, "_splits", lambda kernel, device, m_tiles, n_blocks, k_stages,
                        *_: (1, k_stages))
    k, n = 256, 128
    packed = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                          torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)

    def launches() -> list:
        launched.clear()
        for m in (1, quant.PROGRAMMATIC_MIN_ROWS - 1, quant.PROGRAMMATIC_MIN_ROWS,
                  quant.PROGRAMMATIC_ROWS, quant.PROGRAMMATIC_ROWS + 1):
            quant._kernel_product(torch.zeros(m, k, dtype=torch.bfloat16), packed, None,
                                  torch.empty(m, n, dtype=torch.bfloat16), (64, ""))
        return launched[:]

    assert launches() == [False] * 5  # not prepared: plain
    monkeypatch.setattr(quant._compile, "programmatic_launch", lambda device: False)
    assert quant.set_programmatic(0, True) is False and launches() == [False] * 5
    monkeypatch.setattr(quant._compile, "programmatic_launch", lambda device: True)

    def refused(device):
        raise RuntimeError("cuLaunchKernelEx failed (1: invalid argument)")

    for check, warning in ((refused, "invalid argument"), (lambda device: False, None)):
        monkeypatch.setattr(quant, "_programmatic_agrees", check)
        caplog.clear()
        assert quant.set_programmatic(0, True) is False and launches() == [False] * 5
        assert warning is None or warning in caplog.text
    monkeypatch.setattr(quant, "_programmatic_agrees", lambda device: True)
    assert quant.set_programmatic(0, True) is True and quant.launches_programmatically(0)
    assert launches() == [False, False, True, True, False]
    assert quant.set_programmatic(0, False) is False and launches() == [False] * 5
