"""CPU checks of the kernel launchers: input validation raises ValueError before any launch, the
decode split plan, and the source loader (CI; needs neither CuPy nor a GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import _compile, attention, cache


def test_importing_launchers_does_not_import_cupy():
    code = ("import sys, kernels, kernels.attention, kernels.cache, kernels._compile; "
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
        cache.swap_blocks(t, t, t, t, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        cache.swap_blocks(t, t, t, t, torch.tensor([0, 1]))


@pytest.mark.parametrize("num_seqs,max_blocks,block_size", [(64, 256, 16), (256, 64, 16), (1, 1024, 16),
                                                           (3, 2000, 32), (8, 1, 16)])
def test_decode_split_plan_covers_every_page(num_seqs, max_blocks, block_size):
    splits, chunk = attention.decode_splits(num_seqs, 8, max_blocks, block_size, num_sms=132)
    assert splits * chunk >= max_blocks > (splits - 1) * chunk
    assert chunk <= 256 and (chunk * block_size) % 64 == 0 or chunk * block_size >= max_blocks * block_size


def test_sources_inline_local_headers_once():
    src = _compile.load_source("attention.cu")
    assert '#include "common.cuh"' not in src and src.count("struct Pack<__half>") == 1
    assert _compile.arch_options("90")[0] == ("-arch=sm_90a",)
    assert _compile.arch_options("80")[0] == ("-arch=sm_80",)
