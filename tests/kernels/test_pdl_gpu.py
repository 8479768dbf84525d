"""Programmatic dependent launch (kernels._compile.PDL, sm_90+): the elementwise kernels and
decode attention launched with it, after cuBLAS products and after one another as in a decode
step, eagerly and from a CUDA graph, give the same bits as plain launches."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu import gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]


def test_pdl_launches_give_the_plain_launches_bits(monkeypatch):
    from kernels import _compile, attention, ops
    from tests.kernels.test_ops_gpu import rope_tables

    _compile.warmup()
    g = torch.Generator(device="cuda").manual_seed(31)
    dt = torch.bfloat16
    seqs, hidden, heads, kv_heads, hd, inter, bs = 48, 4096, 32, 8, 128, 14336, 16
    width = 64  # pages per table
    w_qkv = (torch.randn(hidden + 2 * kv_heads * hd, hidden, generator=g, device="cuda") * 0.02).to(dt)
    w_up = (torch.randn(2 * inter, hidden, generator=g, device="cuda") * 0.02).to(dt)
    norm_w = torch.randn(hidden, generator=g, device="cuda").to(dt)
    cos, sin = rope_tables(hd)
    lens = torch.randint(1, width * bs, (seqs,), generator=g, device="cuda", dtype=torch.int32)
    tables = torch.randperm(seqs * width, generator=g, device="cuda").view(seqs, width).int()
    k_cache = torch.randn(seqs * width, kv_heads, bs, hd, generator=g, device="cuda").to(dt)
    v_cache = torch.randn_like(k_cache)
    pos = (lens - 1).long()
    slots = (tables.long().gather(1, (pos // bs).view(-1, 1)).view(-1) * bs + pos % bs)
    x0 = torch.randn(seqs, hidden, generator=g, device="cuda").to(dt)
    res0 = torch.randn(seqs, hidden, generator=g, device="cuda").to(dt)

    def step(state):
        x, res, kc, vc = state["x"], state["res"], state["k"], state["v"]
        ops.fused_add_rms_norm(x, res, norm_w, 1e-5)
        qkv = F.linear(x, w_qkv)
        q, k, v = qkv.split([hidden, kv_heads * hd, kv_heads * hd], dim=-1)
        q, k, v = (t.view(seqs, -1, hd) for t in (q, k, v))
        ops.rotary_embedding_and_cache(pos, q, k, v, cos, sin, kc, vc, slots)
        o = attention.paged_decode_attention(q, kc, vc, tables, lens, hd ** -0.5)
        h = ops.rms_norm(o.reshape(seqs, hidden), norm_w, 1e-5)
        state["out"] = ops.silu_and_mul(F.linear(h, w_up))

    def fresh():
        return {"x": x0.clone(), "res": res0.clone(), "k": k_cache.clone(), "v": v_cache.clone()}

    monkeypatch.setattr(_compile, "PDL", False)
    plain = fresh()
    step(plain)
    monkeypatch.setattr(_compile, "PDL", True)
    eager = fresh()
    step(eager)
    for name in ("out", "x", "res", "k", "v"):
        assert torch.equal(eager[name], plain[name]), f"{name}: PDL launches differ"
    static = fresh()
    step(static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static)
    for _ in range(3):
        for name, t in fresh().items():
            static[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        for name in ("out", "x", "res", "k", "v"):
            assert torch.equal(static[name], plain[name]), f"{name}: replay differs"
