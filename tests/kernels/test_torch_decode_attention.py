"""reference.torch_decode_attention (the CUDA backend's decode attention for float32 models and
head sizes without a kernel) reads every page of a table row; whatever lies past a sequence's
length must not reach its output. Pure torch: runs on CPU."""
from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import reference


def test_garbage_past_the_context_never_reaches_the_output():
    gen = torch.Generator().manual_seed(5)
    num_blocks, kv_heads, block_size, head_dim, heads = 12, 2, 4, 16, 4
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    tables = torch.tensor([[3, 7, 9, 0], [5, 1, 0, 0], [2, 0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 5, 4], dtype=torch.int32)
    owned = {(3, 0), (3, 1), (3, 2), (3, 3), (7, 0), (7, 1), (7, 2), (7, 3), (9, 0), (9, 1),
             (5, 0), (5, 1), (5, 2), (5, 3), (1, 0), (2, 0), (2, 1), (2, 2), (2, 3)}
    for block in range(num_blocks):
        for slot in range(block_size):
            if (block, slot) not in owned:  # stale pages and unwritten slots: poison
                k_cache[block, :, slot] = float("nan")
                v_cache[block, :, slot] = float("nan")
    q = torch.randn(3, heads, head_dim, generator=gen)
    out = reference.torch_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    expected = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                                tables, seq_lens, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,cap", [(1, None), (5, None), (6, None), (100, None), (None, 2.0),
                                        (3, 2.0)])
def test_window_and_soft_cap_as_the_reference(window, cap):
    """The capturable twin with a layer's window and soft-cap gives the reference's result
    (query at seq_len - 1 sees keys seq_len - W .. seq_len - 1; scores capped before the mask);
    a window past every context is full attention."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, kv_heads, block_size, head_dim, heads = 16, 2, 4, 16, 4
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(4, 4)
    seq_lens = torch.tensor([16, 5, 1, 11], dtype=torch.int32)
    q = torch.randn(4, heads, head_dim, generator=gen) * 3
    out = reference.torch_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25,
                                           sliding_window=window, soft_cap=cap)
    expected = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                                tables, seq_lens, 0.25, sliding_window=window,
                                                soft_cap=cap)
    plain = reference.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                             tables, seq_lens, 0.25)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(plain, expected) == (window == 100)  # the case tells them apart
