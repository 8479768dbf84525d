"""CPU checks of the kernel launchers: input validation raises ValueError before any launch, the
decode split plan, and the source loader (CI; needs neither CuPy nor a GPU)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve_kernels import _compile, attention, cache_ops, ops


def test_importing_launchers_does_not_import_cupy():
    code = ("import sys, pagedserve_kernels, pagedserve_kernels.attention, "
            "pagedserve_kernels.cache_ops, pagedserve_kernels.ops, pagedserve_kernels._compile; "
            "assert 'cupy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


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
                 lambda: ops.silu_and_mul(x),
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


def test_ops_module_lists_every_kernel_of_ops_cu():
    src = _compile.load_source("ops.cu")
    ops_names = re.findall(r"\b(\w+)_##NAME\(", src)  # PS_OPS's four, PS_ROPE_CACHE's one
    dtypes = re.findall(r"^PS_OPS\((\w+),", src, re.MULTILINE)
    rope_cache = re.findall(r"^PS_ROPE_CACHE\((\w+),", src, re.MULTILINE)
    expect = [f"{o}_{d}" for o in ops_names[:4] for d in dtypes]
    expect += [f"{ops_names[4]}_{n}" for n in rope_cache]
    assert sorted(_compile.MODULES["ops"][1]) == sorted(expect)
    assert len(ops_names) == 5 and dtypes == ["bf16", "fp16"] and len(rope_cache) == 4


@pytest.mark.parametrize("module", ["attention", "cache"])
def test_module_lists_every_entry_point_of_its_source(module):
    """warmup compiles what MODULES lists: every extern "C" kernel of the source, instantiated
    by a PS_ macro or written out, and nothing else."""
    filename, listed = _compile.MODULES[module]
    src = _compile.load_source(filename)
    by_macro = re.findall(r"^PS_\w+\((\w+),", src, re.MULTILINE)
    written = re.findall(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(',
                         src, re.MULTILINE)
    assert sorted(listed) == sorted(by_macro + written)


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
