"""reference.torch_decode_attention (the CUDA backend's decode attention for float32 models and
head sizes without a kernel) reads every page of a table row; whatever lies past a sequence's
length must not reach its output. Pure torch: runs on CPU."""
from __future__ import annotations

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
