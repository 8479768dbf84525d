"""BENCHMARK.md's kernel workloads on one GPU, in one command; prints a table (and --json).

  PYTHONPATH=. python3 benchmarks/bench_kernels.py [--json out.json] [--skip-compile] [--fusions]
  PYTHONPATH=. python3 benchmarks/bench_kernels.py --only prefill decode --vllm-fa3 /tmp/vllm_site

Ratios are measured in the same run: prefill vs torch SDPA's flash backend on contiguous KV,
decode and copy_blocks vs a measured device-to-device copy, swap_blocks vs one large pinned copy
and vs a loop of cudaMemcpyAsync per page and layer; `--only decode_fp8`: decode over the same
pages in an FP8 cache (their bytes counted as FP8's); `--only sampling`: the seeded draw through
the race kernel against the torch ops it replaces; with --fusions, the elementwise ops of a
Llama-3-8B layer (pagedserve_kernels.ops) vs their torch twins; with --vllm-fa3 SITE, prefill and
paged decode also side by side with vLLM's FlashAttention-3 (`vllm.vllm_flash_attn` from SITE, as
../shared/bench/vllm/install_on_gpu.sh leaves it) on the same shapes, timed the same way in a child
process that alone has SITE on its path. Medians of CUDA-event timings after warm-up, with inputs
rotated between iterations.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve_kernels import _compile, attention, cache_ops, ops, reference  # noqa: E402
from pagedserve_kernels.gemm import graph_us  # noqa: E402

GIB = 1 << 30


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median of `iters` event-timed calls fn(i) after `warmup` untimed ones."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), iters=10)
    return 2 * src.numel() / (ms * 1e-3)


def paged_inputs(num_seqs, ctx, kv_heads, head_dim, block_size, rotations=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = ctx // block_size
    num_blocks = num_seqs * pages
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    tables = [torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32).view(num_seqs, pages)
              for _ in range(rotations)]
    return k_cache, v_cache, tables


def contiguous_kv(cache_t, table):
    """[num_blocks, kvh, bs, d] pages of each sequence -> [num_seqs, kvh, ctx, d]."""
    pages = cache_t[table.long()]  # [seqs, pages, kvh, bs, d]
    s, p, h, b, d = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(s, h, p * b, d)


def bench_prefill(head_dim, q_len, ctx=4096, num_seqs=8, heads=32, kv_heads=8, block_size=16,
                  variant="default"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k_cache, v_cache, tables = paged_inputs(num_seqs, ctx, kv_heads, head_dim, block_size)
    g = torch.Generator(device="cuda").manual_seed(1)
    qs = [torch.randn(num_seqs * q_len, heads, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
          for _ in range(2)]
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(qs[0])
    scale = head_dim**-0.5
    ours = median_ms(lambda i: attention.paged_prefill_attention(
        qs[i % 2], k_cache, v_cache, tables[i % 2], cu, lens, scale, out=out, variant=variant))
    pairs = sum(ctx - q_len + i + 1 for i in range(q_len))  # attended (query, key) pairs per head
    flops = 4 * head_dim * pairs * heads * num_seqs
    if q_len == ctx:
        flops_std = 4 * ctx * ctx * head_dim / 2 * heads * num_seqs  # BENCHMARK.md's causal count
    else:
        flops_std = flops

    # torch SDPA flash backend on contiguous K/V of the same shapes.
    kc = [contiguous_kv(k_cache, t) for t in tables]
    vc = [contiguous_kv(v_cache, t) for t in tables]
    qsd = [q.view(num_seqs, q_len, heads, head_dim).transpose(1, 2) for q in qs]
    if q_len == ctx:
        mask_kw = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask_kw = {"attn_mask": causal_lower_right(q_len, ctx)}
    group = heads // kv_heads
    variants = {
        "enable_gqa": lambda i: F.scaled_dot_product_attention(
            qsd[i % 2], kc[i % 2], vc[i % 2], scale=scale, enable_gqa=True, **mask_kw),
        "KV heads repeated": lambda i: F.scaled_dot_product_attention(
            qsd[i % 2], rep[0][i % 2], rep[1][i % 2], scale=scale, **mask_kw),
    }
    rep = []
    ref_ms, check, note = float("nan"), None, "SDPA flash failed"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for name, fn in variants.items():
            if name == "KV heads repeated":  # outside the timing, as a model would store them
                rep[:] = [[k.repeat_interleave(group, 1) for k in kc], [v.repeat_interleave(group, 1) for v in vc]]
            try:
                fn(0)
            except Exception as exc:  # flash refused this form: try the next one
                note = f"{name} refused: {str(exc)[:80]}"
                continue
            ref_ms, check, note = median_ms(fn), fn(1), name
            break
    attention.paged_prefill_attention(qs[1], k_cache, v_cache, tables[1], cu, lens, scale, out=out,
                                      variant=variant)
    ours_view = out.view(num_seqs, q_len, heads, head_dim).transpose(1, 2).float()
    diff = float("nan") if check is None else (
        (ours_view - check.float()).norm() / check.float().norm()).item()
    return {
        "ms": ours, "tflops": flops_std / ours * 1e-9, "sdpa_ms": ref_ms,
        "sdpa_tflops": flops_std / ref_ms * 1e-9, "ratio": ref_ms / ours,
        "exact_pair_tflops": flops / ours * 1e-9, "rel_diff_vs_sdpa": diff, "sdpa_note": note,
    }


def decode_inputs(num_seqs, ctx, heads, kv_heads, head_dim, block_size):
    """Shuffled pages of `ctx` tokens per sequence, two sets of tables and of q, lengths, out."""
    k_cache, v_cache, tables = paged_inputs(num_seqs, ctx, kv_heads, head_dim, block_size, seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    qs = [torch.randn(num_seqs, heads, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
          for _ in range(2)]
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, qs, lens, torch.empty_like(qs[0])


FP8_KV_SCALE = 4 / 448  # standard normal K/V: the few past 4 sigma saturate


def bench_decode(num_seqs, ctx, copy_bw, heads=32, kv_heads=8, head_dim=128, block_size=16,
                 fp8=False):
    """fp8: the same pages in an FP8 (e4m3) cache, --kv-cache-dtype fp8's, half the bytes."""
    k_cache, v_cache, tables, qs, lens, out = decode_inputs(num_seqs, ctx, heads, kv_heads,
                                                            head_dim, block_size)
    scales = {}
    if fp8:
        scale = torch.tensor(FP8_KV_SCALE, device="cuda")
        k_cache, v_cache = (reference.quantize_kv(c, scale) for c in (k_cache, v_cache))
        scales = dict(k_scale=scale, v_scale=scale)
    # 7 blocks of 40 timed calls (after a warm-up); the median of the block medians is reported,
    # with the spread of the blocks (the 1 GB of K/V does not fit in L2: rotation only varies q).
    blocks = [median_ms(lambda i: attention.paged_decode_attention(
        qs[i % 2], k_cache, v_cache, tables[i % 2], lens, head_dim**-0.5, out=out, **scales),
        iters=40, warmup=10 if b == 0 else 2) for b in range(7)]
    ms = statistics.median(blocks)
    kv_bytes = 2 * num_seqs * ctx * kv_heads * head_dim * k_cache.element_size()
    splits, _ = attention.decode_splits(num_seqs, kv_heads, tables[0].shape[1], block_size,
                                        torch.cuda.get_device_properties(0).multi_processor_count)
    bw = kv_bytes / (ms * 1e-3)
    return {"ms": ms, "GBps": bw / 1e9, "frac_copy_bw": bw / copy_bw, "splits": splits,
            "block_ms_min": min(blocks), "block_ms_max": max(blocks)}


def bench_decode_sweep(num_seqs, ctx, copy_bw, rounds=5, heads=32, kv_heads=8, head_dim=128,
                       block_size=16):
    """Decode kernel candidates x split policies on one set of inputs, timed in interleaved rounds
    (one block of 40 calls per candidate per round) so drift hits all alike; medians of rounds."""
    k_cache, v_cache, tables, qs, lens, out = decode_inputs(num_seqs, ctx, heads, kv_heads,
                                                            head_dim, block_size)
    candidates = [(variant, ctas) for variant in ("default", "s2") for ctas in (4, 8, 12, 16, 24)]
    times: dict = {c: [] for c in candidates}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for r in range(rounds):
        for variant, ctas in candidates:
            times[(variant, ctas)].append(median_ms(lambda i: attention.paged_decode_attention(
                qs[i % 2], k_cache, v_cache, tables[i % 2], lens, head_dim**-0.5, out=out,
                variant=variant, ctas_per_sm=ctas), iters=40, warmup=5 if r == 0 else 2))
    kv_bytes = 2 * num_seqs * ctx * kv_heads * head_dim * 2
    result = {}
    for (variant, ctas), ts in times.items():
        ms = statistics.median(ts)
        splits, _ = attention.decode_splits(num_seqs, kv_heads, tables[0].shape[1], block_size,
                                            sms, ctas)
        kernel, _ = attention.decode_kernel(torch.bfloat16, head_dim, variant)
        result[f"{kernel} ctas/SM {ctas}"] = {
            "ms": ms, "frac_copy_bw": kv_bytes / (ms * 1e-3) / copy_bw, "splits": splits,
            "round_ms_min": min(ts), "round_ms_max": max(ts)}
    return result


RAGGED_BATCHES = (8, 16, 32, 48, 64, 96, 128, 192, 256)
# Decode split policies timed beside the launcher's default: paged_decode_attention's split
# keywords (pages a split may span, CTAs per SM the splits aim for, few seqs or many alike).
DECODE_POLICY_CANDIDATES = {"256 pages, 12/SM (before)": dict(max_pages=256, ctas_per_sm=12),
                            "1024 pages, 12/SM": dict(max_pages=1024, ctas_per_sm=12),
                            "1024 pages, 4/SM": dict(max_pages=1024, ctas_per_sm=4)}


def graph_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """Per-call GPU time of fn() (a few kernel launches) from a CUDA graph of `calls` of them,
    median of `replays` replays (pagedserve_kernels.gemm.graph_us): no host launch time between the
    kernels, as in a decode graph."""
    return graph_us(lambda: [fn() for _ in range(calls)], replays) / 1e3 / calls


def bench_decode_ragged(copy_bw, batches=RAGGED_BATCHES, context=(64, 1792), width=512,
                        rounds=5, heads=32, kv_heads=8, head_dim=128, block_size=16) -> dict:
    """The decode kernel as a decode graph runs it: contexts uniform in `context`, tables
    `width` pages wide (the graph's: max_model_len / block size, 512 for W4's 8,192; W1-W3 run
    the default 4,096, 256 pages), timed inside CUDA graphs; the
    launcher's split policy against DECODE_POLICY_CANDIDATES, and the seqs in the order
    ModelRunner._apply gives them (longest first); interleaved in rounds (a graph captured per
    variant and round: a policy may regrow the partials' workspace); medians."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = torch.Generator().manual_seed(5)
    # name -> (policy, seqs by descending context, as model_runner orders a step's)
    policies = {"default": {}, **DECODE_POLICY_CANDIDATES}
    variants = {f"{name}{', longest first' * ordered}": (policy, ordered)
                for ordered in (True, False) for name, policy in policies.items()}
    result = {}
    for bs in batches:
        lens_list = torch.randint(context[0], context[1] + 1, (bs,), generator=rng).tolist()
        pages = [-(-n // block_size) for n in lens_list]
        num_blocks = sum(pages)
        g = torch.Generator(device="cuda").manual_seed(bs)
        shape = (num_blocks, kv_heads, block_size, head_dim)
        k_cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
        tables = torch.zeros(bs, width, dtype=torch.int32, device="cuda")
        at = 0
        for i, p in enumerate(pages):
            tables[i, :p] = perm[at:at + p]
            at += p
        lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
        q = torch.randn(bs, heads, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        longest = torch.argsort(lens, descending=True)
        inputs = {False: (q, tables, lens),
                  True: (q[longest].contiguous(), tables[longest].contiguous(),
                         lens[longest].contiguous())}
        times: dict = {name: [] for name in variants}
        for _ in range(rounds):
            for name, (policy, ordered) in variants.items():
                q_in, tables_in, lens_in = inputs[ordered]
                times[name].append(graph_ms(lambda: attention.paged_decode_attention(
                    q_in, k_cache, v_cache, tables_in, lens_in, head_dim**-0.5, out=out,
                    **policy)))
        kv_bytes = 2 * sum(lens_list) * kv_heads * head_dim * 2
        row = {"mean_context": sum(lens_list) / bs, "policies": {}}
        for name, ts in times.items():
            ms = statistics.median(ts)
            splits = attention.decode_splits(bs, kv_heads, width, block_size, sms,
                                             **variants[name][0])[0]
            row["policies"][name] = {
                "us": ms * 1e3, "frac_copy_bw": kv_bytes / (ms * 1e-3) / copy_bw, "splits": splits,
                "round_us_min": min(ts) * 1e3, "round_us_max": max(ts) * 1e3}
        result[bs] = row
    return result


def bench_swap_and_copy(copy_bw, layers=32, kv_heads=8, block_size=16, head_dim=128,
                        gpu_blocks=8192, pairs=1024):
    import cupy

    g = torch.Generator(device="cuda").manual_seed(4)
    shape = (layers, gpu_blocks, kv_heads, block_size, head_dim)
    gpu_k = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
    gpu_v = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
    cpu_shape = (layers, pairs, kv_heads, block_size, head_dim)
    cpu_k = torch.empty(cpu_shape, dtype=torch.bfloat16, pin_memory=True)
    cpu_v = torch.empty(cpu_shape, dtype=torch.bfloat16, pin_memory=True)
    cpu_k.copy_(gpu_k[:, :pairs])
    cpu_v.copy_(gpu_v[:, :pairs])
    perm = torch.randperm(gpu_blocks, generator=g, device="cuda")
    cpu_ids = torch.randperm(pairs, generator=g, device="cuda")
    out_maps = [torch.stack([perm[r * pairs:(r + 1) * pairs], cpu_ids], 1) for r in range(2)]
    in_maps = [torch.stack([cpu_ids, perm[(2 + r) * pairs:(3 + r) * pairs]], 1) for r in range(2)]
    page_bytes = kv_heads * block_size * head_dim * 2
    moved = pairs * layers * 2 * page_bytes
    res = {"bytes": moved}
    res["d2h_ms"] = median_ms(lambda i: cache_ops.swap_blocks(gpu_k, gpu_v, cpu_k, cpu_v, out_maps[i % 2]), iters=5)
    res["h2d_ms"] = median_ms(lambda i: cache_ops.swap_blocks(cpu_k, cpu_v, gpu_k, gpu_v, in_maps[i % 2]), iters=5)
    half = moved // 4  # bf16 elements in half of the moved bytes (K's share, then V's)
    flat_gpu, flat_gpu2 = gpu_k.view(-1)[:half], gpu_v.view(-1)[:half]
    flat_cpu = torch.empty(half, dtype=torch.bfloat16, pin_memory=True)
    flat_cpu2 = torch.empty(half, dtype=torch.bfloat16, pin_memory=True)

    def big(i, to_host):
        if to_host:
            flat_cpu.copy_(flat_gpu, non_blocking=True)
            flat_cpu2.copy_(flat_gpu2, non_blocking=True)
        else:
            flat_gpu.copy_(flat_cpu, non_blocking=True)
            flat_gpu2.copy_(flat_cpu2, non_blocking=True)

    res["big_d2h_ms"] = median_ms(lambda i: big(i, True), iters=5)
    res["big_h2d_ms"] = median_ms(lambda i: big(i, False), iters=5)

    stream = _compile.current_stream(torch.device("cuda", 0))
    memcpy = cupy.cuda.runtime.memcpyAsync
    layer_bytes_gpu, layer_bytes_cpu = gpu_blocks * page_bytes, pairs * page_bytes
    out_list = [out_maps[r].tolist() for r in range(2)]
    in_list = [in_maps[r].tolist() for r in range(2)]

    def loop(i, to_host):
        pairs_list = (out_list if to_host else in_list)[i % 2]
        for base_g, base_c in ((gpu_k.data_ptr(), cpu_k.data_ptr()), (gpu_v.data_ptr(), cpu_v.data_ptr())):
            for layer in range(layers):
                lg, lc = base_g + layer * layer_bytes_gpu, base_c + layer * layer_bytes_cpu
                for s, d in pairs_list:
                    if to_host:
                        memcpy(lc + d * page_bytes, lg + s * page_bytes, page_bytes, 4, stream.ptr)
                    else:
                        memcpy(lg + d * page_bytes, lc + s * page_bytes, page_bytes, 4, stream.ptr)

    res["loop_d2h_ms"] = median_ms(lambda i: loop(i, True), iters=3, warmup=1)
    res["loop_h2d_ms"] = median_ms(lambda i: loop(i, False), iters=3, warmup=1)

    cow = [torch.stack([perm[(4 + 2 * r) * pairs:(5 + 2 * r) * pairs],
                        perm[(5 + 2 * r) * pairs:(6 + 2 * r) * pairs]], 1) for r in range(2)]
    res["copy_blocks_ms"] = median_ms(lambda i: cache_ops.copy_blocks(gpu_k, gpu_v, cow[i % 2]), iters=20)
    res["copy_blocks_frac"] = 2 * moved / (res["copy_blocks_ms"] * 1e-3) / copy_bw
    for k in ("d2h", "h2d", "big_d2h", "big_h2d", "loop_d2h", "loop_h2d"):
        res[k + "_GBps"] = moved / (res[k + "_ms"] * 1e-3) / 1e9
    return res


def bench_fusions(num_tokens, copy_bw, layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8,
                  head_dim=128, max_pos=8192):
    """The elementwise part of one Llama-3-8B layer as the model runs it (fused add + RMSNorm
    twice, RoPE on the q/k views of a fused qkv output, SiLU-and-mul): the kernels vs the torch
    twins, bf16. Timed eagerly (one layer per call) and as one CUDA graph of `layers` layers
    (how decode runs); microseconds per layer. The floor is the kernels' bytes over copy_bw."""
    g = torch.Generator(device="cuda").manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    x, residual, gate_up = rand(num_tokens, hidden), rand(num_tokens, hidden), rand(num_tokens, 2 * inter)
    qkv = rand(num_tokens, q_size + 2 * kv_size)
    q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, kv_heads, head_dim)
    norm1, norm2 = rand(hidden), rand(hidden)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g, device="cuda")
    angles = torch.rand(max_pos, head_dim, generator=g, device="cuda") * 6.3
    cos_table, sin_table = angles.cos(), angles.sin()

    def layer(impl):
        impl.fused_add_rms_norm(x, residual, norm1, 1e-5)
        impl.rotary_embedding(positions, q, k, cos_table, sin_table)
        impl.fused_add_rms_norm(x, residual, norm2, 1e-5)
        impl.silu_and_mul(gate_up)

    res = {}
    for label, impl in (("fused", ops), ("torch", reference)):
        res[f"{label}_eager_us"] = median_ms(lambda i: layer(impl), iters=50, warmup=5) * 1e3
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(impl)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(layers):
                layer(impl)
        res[f"{label}_graph_us"] = median_ms(lambda i: graph.replay(), iters=20) * 1e3 / layers
    moved = 2 * (4 * num_tokens * hidden + hidden) + 2 * num_tokens * (q_size + kv_size) \
        + 3 * num_tokens * inter
    res["bytes"] = 2 * moved + 2 * num_tokens * head_dim * 4  # bf16 elements + cos/sin rows
    res["floor_us"] = res["bytes"] / copy_bw * 1e6
    for mode in ("eager", "graph"):
        res[f"ratio_{mode}"] = res[f"torch_{mode}_us"] / res[f"fused_{mode}_us"]
    return res


# Llama-3-8B's matrix products per layer, (name, out features, in features), and the token
# counts steps actually have: decode batches, W2's mixed steps (~256 + ~1,100), full 8k/16k steps.
MATMUL_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                 ("down", 4096, 14336))
MATMUL_TOKENS = (64, 128, 256, 257, 384, 512, 1024, 1333, 1344, 2048, 2400, 4096, 8192, 16384)


def bench_matmul(tokens=MATMUL_TOKENS, shapes=MATMUL_SHAPES) -> dict:
    """cuBLAS (F.linear, bf16) TFLOP/s per layer shape at each token count, and the layer's four
    products together; against an 8192^3 matmul in the same run."""
    out = {"peak_tflops": _square_matmul_tflops()}
    for n in tokens:
        x = {k: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _, _, k in shapes}
        total_ms, total_flops, row = 0.0, 0, {}
        for name, m, k in shapes:
            w = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ms = median_ms(lambda i: torch.nn.functional.linear(x[k], w), iters=20)
            row[name] = round(2 * n * m * k / ms / 1e9, 1)
            total_ms, total_flops = total_ms + ms, total_flops + 2 * n * m * k
        row["layer_ms"] = round(total_ms, 4)
        row["layer_tflops"] = round(total_flops / total_ms / 1e9, 1)
        out[n] = row
    return out


def _square_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return round(2 * n ** 3 / median_ms(lambda i: a @ b, iters=10) / 1e9, 1)


# (name, head_dim, new query tokens per sequence, context, sequences) of the prefill cases, and
# (sequences, context) of the decode cases: the same shapes for ours and FA3.
PREFILL_CASES = (("prefill hd128 8x4096", 128, 4096, 4096, 8), ("prefill hd64 8x4096", 64, 4096, 4096, 8),
                 ("prefill chunk 512 on 3584", 128, 512, 4096, 8))
DECODE_CASES = ((64, 4096), (256, 1024))


def fa3_worker(path: Path, heads=32, kv_heads=8, block_size=16) -> None:
    """In the child process: vLLM's FA3 on PREFILL_CASES and DECODE_CASES, paged (its layout:
    [blocks, block_size, kv_heads, head_dim]), shuffled pages, inputs rotated as for ours."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def inputs(num_seqs, ctx, q_len, head_dim, seed, fp8=False):
        """fp8: an FP8 cache as vLLM's FA3 backend reads one, q quantized to FP8 too (it
        quantizes q when the cache is FP8) with per-sequence, per-KV-head descales."""
        g = torch.Generator(device="cuda").manual_seed(seed)
        pages = ctx // block_size
        shape = (num_seqs * pages, block_size, kv_heads, head_dim)
        k = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        descale = {}
        if fp8:
            scale = torch.tensor(FP8_KV_SCALE, device="cuda")
            k, v = (reference.quantize_kv(c, scale) for c in (k, v))  # as ours are written
            one = torch.full((num_seqs, kv_heads), FP8_KV_SCALE, device="cuda")
            descale = dict(q_descale=torch.ones_like(one), k_descale=one, v_descale=one)
        tables = [torch.randperm(num_seqs * pages, generator=g, device="cuda").to(torch.int32)
                  .view(num_seqs, pages) for _ in range(2)]
        qs = [torch.randn(num_seqs * q_len, heads, head_dim, generator=g, device="cuda",
                          dtype=torch.bfloat16) for _ in range(2)]
        if fp8:
            qs = [q.to(torch.float8_e4m3fn) for q in qs]
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
        used = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
        return lambda i: flash_attn_varlen_func(
            qs[i % 2], k, v, max_seqlen_q=q_len, cu_seqlens_q=cu, max_seqlen_k=ctx,
            seqused_k=used, causal=True, block_table=tables[i % 2], fa_version=3, **descale)

    out = {}
    for name, head_dim, q_len, ctx, num_seqs in PREFILL_CASES:
        out[name] = {"ms": median_ms(inputs(num_seqs, ctx, q_len, head_dim, 0))}
    for fp8 in (False, True):
        for num_seqs, ctx in DECODE_CASES:
            try:
                fn = inputs(num_seqs, ctx, 1, 128, 2, fp8)
                blocks = [median_ms(fn, iters=40, warmup=10 if b == 0 else 2) for b in range(7)]
            except Exception as e:  # noqa: BLE001  (an FP8 call FA3 refuses: the others stand)
                print(f"FA3 decode {num_seqs}x{ctx} fp8={fp8}: {e!r}", flush=True)
                continue
            out[f"decode {num_seqs}x{ctx}{' fp8 cache' * fp8}"] = {
                "ms": statistics.median(blocks), "block_ms_min": min(blocks),
                "block_ms_max": max(blocks)}
    path.write_text(json.dumps(out))


def run_fa3(site: str) -> dict:
    """FA3's times from a child process with `site` first on its path (its packages are newer
    than this image's and must not reach this process)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fa3.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, str(ROOT)]),
               "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        subprocess.run([sys.executable, __file__, "--fa3-worker", str(path)], env=env, check=True)
        return json.loads(path.read_text())


def fa3_rows(results: dict, fa3: dict, copy_bw: float) -> list[tuple]:
    """A row per FA3 case and each of our results on its shapes: the default ("case") and the
    candidates of --variants ("case [variant]")."""
    rows = []
    for case, theirs in fa3.items():
        for name, ours in results.items():
            if name == case or name.startswith(f"{case} ["):
                rows.append(_fa3_row(name, ours, theirs, copy_bw))
    return rows


def _fa3_row(name: str, ours: dict, theirs: dict, copy_bw: float) -> tuple:
    if name.startswith("prefill"):
        rate = ours["tflops"] * ours["ms"] / theirs["ms"]
        theirs["tflops"] = rate
        return (f"{name} vs vLLM FA3", f"{ours['ms']:.3f} ms ({ours['tflops']:.0f} TFLOP/s)",
                f"FA3 {theirs['ms']:.3f} ms ({rate:.0f} TFLOP/s)", "",
                f"{theirs['ms'] / ours['ms']:.2f}x FA3")
    bw = ours["GBps"] * ours["ms"] / theirs["ms"]
    theirs["frac_copy_bw"] = bw * 1e9 / copy_bw
    return (f"{name} vs vLLM FA3", f"{ours['ms'] * 1e3:.0f} us",
            f"FA3 {theirs['ms'] * 1e3:.0f} us ({100 * theirs['frac_copy_bw']:.0f}% of copy bw)",
            f"FA3 blocks {theirs['block_ms_min'] * 1e3:.0f}-{theirs['block_ms_max'] * 1e3:.0f} us",
            f"{theirs['ms'] / ours['ms']:.2f}x FA3")


def compile_times() -> dict:
    """warmup() in fresh processes: cold (empty CUPY_CACHE_DIR), then cached."""
    code = ("import json; from pagedserve_kernels import _compile; "
            "print(json.dumps(_compile.warmup()))")
    res = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, CUPY_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
        for label in ("cold", "cached"):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True)
            res[label] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


SAMPLING_ROWS = (1, 64, 256, 1024)


def bench_sampling(rows=SAMPLING_ROWS, vocab: int = 128_256) -> dict:
    """The Sampler's seeded draw from [rows, vocab] float32 logits (Llama-3's vocabulary) at
    temperature 0.8, µs: the race (scaled logits + noise, argmax) through the kernel (the default
    on CUDA) and through the torch ops it replaces; the whole sample() (logprobs included)
    without filters and with top-p 0.9 (the sort)."""
    from executor_svc.sampler import Sampler, SamplingTensors, filtered_logits, race_argmax
    from executor_svc.step import SamplingOptions

    sampler, out = Sampler(), {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in rows:
        logits = [torch.randn(n, vocab, generator=g, device="cuda") * 4 for _ in range(2)]
        plain = SamplingTensors.build([SamplingOptions(temperature=0.8, seed=i) for i in range(n)],
                                      list(range(n)), vocab, torch.device("cuda"))
        top_p = SamplingTensors.build([SamplingOptions(temperature=0.8, top_p=0.9, seed=i)
                                       for i in range(n)], list(range(n)), vocab,
                                      torch.device("cuda"))
        def race(fused: bool):
            return median_ms(lambda i: race_argmax(filtered_logits(logits[i % 2], plain),
                                                   plain.row_seeds, fused=fused))

        kernel, torch_ops = race(True), race(False)
        sample = median_ms(lambda i: sampler.sample(logits[i % 2], plain))
        filtered = median_ms(lambda i: sampler.sample(logits[i % 2], top_p))
        out[n] = {"kernel_race_us": kernel * 1e3, "torch_race_us": torch_ops * 1e3,
                  "sample_us": sample * 1e3, "top_p_us": filtered * 1e3,
                  "logits_GB": n * vocab * 4 / 1e9}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write all numbers here too")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--variants", action="store_true", help="also time candidate kernels")
    parser.add_argument("--fusions", action="store_true",
                        help="also time the elementwise ops of a Llama-3-8B layer "
                             "(pagedserve_kernels.ops) against their torch twins")
    parser.add_argument("--vllm-fa3", metavar="SITE", default=None,
                        help="also time vLLM's FlashAttention-3 from this site-packages folder "
                             "(e.g. /tmp/vllm_site) on the prefill and decode shapes")
    parser.add_argument("--fa3-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=None,
                        help="subset of: prefill decode decode_fp8 ragged swap compile fusions "
                             "matmul sampling")
    parser.add_argument("--ragged-context", type=int, nargs=2, default=[64, 1792],
                        metavar=("LO", "HI"), help="ragged: contexts drawn uniformly in LO..HI")
    parser.add_argument("--ragged-width", type=int, default=512,
                        help="ragged: block-table width in pages (a decode graph's: "
                             "max_model_len / 16; W1-W3 run 256, W4 512)")
    parser.add_argument("--ragged-batches", type=int, nargs="*", default=list(RAGGED_BATCHES))
    args = parser.parse_args()
    if args.fa3_worker:
        return fa3_worker(args.fa3_worker)
    only = set(args.only or ["prefill", "decode", "swap", "compile"])
    if args.fusions:
        only.add("fusions")
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    warm = _compile.warmup()
    print(f"arch: {_compile.arch_used()}; warmup {warm['total']:.2f} s", flush=True)
    results: dict = {"gpu": torch.cuda.get_device_name(0), "arch": _compile.arch_used()}
    results["copy_bw_GBps"] = copy_bandwidth() / 1e9
    copy_bw = results["copy_bw_GBps"] * 1e9
    print(f"D2D copy bandwidth (read+write): {results['copy_bw_GBps']:.0f} GB/s", flush=True)
    rows = []
    if "prefill" in only:
        cases = [(name, hd, q_len, "default") for name, hd, q_len, _, _ in PREFILL_CASES]
        if args.variants:  # candidate kernels (compiled on their first launch)
            cases += [("prefill hd128 8x4096 [mma.sync v3]", 128, 4096, "mma_sync"),
                      ("prefill hd64 8x4096 [mma.sync v3]", 64, 4096, "mma_sync"),
                      ("prefill hd64 8x4096 [wgmma, 1 CTA/SM]", 64, 4096, "wg1"),
                      ("prefill chunk 512 on 3584 [mma.sync v3]", 128, 512, "mma_sync"),
                      ("prefill hd128 8x4096 [wg, 2 warpgroups]", 128, 4096, "wg"),
                      ("prefill chunk 512 on 3584 [wg, 2 warpgroups]", 128, 512, "wg")]
        for name, hd, q_len, variant in cases:
            r = bench_prefill(hd, q_len, variant=variant)
            results[name] = r
            print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
                  flush=True)
            rows.append((name, f"{r['ms']:.3f} ms", f"{r['tflops']:.0f} TFLOP/s",
                         f"SDPA flash {r['sdpa_tflops']:.0f} TFLOP/s", f"{r['ratio']:.2f}x"))
    for fp8 in [fp8 for fp8, key in ((False, "decode"), (True, "decode_fp8")) if key in only]:
        for seqs, ctx in DECODE_CASES * 2:  # twice: the spread
            name = f"decode {seqs}x{ctx}{' fp8 cache' * fp8}"
            name += " (again)" if name in results else ""
            r = bench_decode(seqs, ctx, copy_bw, fp8=fp8)
            results[name] = r
            print(name, json.dumps(r), flush=True)
            rows.append((name, f"{r['ms'] * 1e3:.0f} us", f"{r['GBps']:.0f} GB/s K+V read",
                         f"splits {r['splits']}, blocks {r['block_ms_min'] * 1e3:.0f}-"
                         f"{r['block_ms_max'] * 1e3:.0f} us",
                         f"{100 * r['frac_copy_bw']:.0f}% of copy bw"))
    if "decode" in only and args.variants:
        for seqs, ctx in ((64, 4096), (256, 1024)):
            sweep = bench_decode_sweep(seqs, ctx, copy_bw)
            results[f"decode sweep {seqs}x{ctx}"] = sweep
            for name, r in sweep.items():
                print(f"decode {seqs}x{ctx} [{name}]", json.dumps(r), flush=True)
                rows.append((f"decode {seqs}x{ctx} [{name}]", f"{r['ms'] * 1e3:.0f} us", "",
                             f"splits {r['splits']}, rounds {r['round_ms_min'] * 1e3:.0f}-"
                             f"{r['round_ms_max'] * 1e3:.0f} us",
                             f"{100 * r['frac_copy_bw']:.0f}% of copy bw"))
    if "ragged" in only:
        lo, hi = args.ragged_context
        r = bench_decode_ragged(copy_bw, args.ragged_batches, (lo, hi), args.ragged_width)
        results["decode ragged"] = r
        for bs, row in r.items():
            print(f"decode ragged {bs}", json.dumps(row), flush=True)
            for name, p in row["policies"].items():
                rows.append((f"decode {bs} seqs, contexts {lo}-{hi}, {args.ragged_width}-page "
                             f"tables [{name}]",
                             f"{p['us']:.0f} us", f"splits {p['splits']}",
                             f"rounds {p['round_us_min']:.0f}-{p['round_us_max']:.0f} us",
                             f"{100 * p['frac_copy_bw']:.0f}% of copy bw"))
    if "swap" in only:
        r = bench_swap_and_copy(copy_bw)
        results["swap"] = r
        print("swap", json.dumps(r), flush=True)
        for d in ("d2h", "h2d"):
            rows.append((f"swap_blocks {d.upper()} 2 GiB", f"{r[d + '_ms']:.2f} ms", f"{r[d + '_GBps']:.1f} GB/s",
                         f"big copy {r['big_' + d + '_GBps']:.1f}, loop {r['loop_' + d + '_GBps']:.1f} GB/s",
                         f"{r[d + '_GBps'] / r['big_' + d + '_GBps']:.2f}x big, "
                         f"{r[d + '_GBps'] / r['loop_' + d + '_GBps']:.1f}x loop"))
        rows.append(("copy_blocks 1024 pairs", f"{r['copy_blocks_ms']:.3f} ms",
                     f"{2 * r['bytes'] / r['copy_blocks_ms'] / 1e6:.0f} GB/s r+w", "",
                     f"{100 * r['copy_blocks_frac']:.0f}% of copy bw"))
    if "fusions" in only:
        for num_tokens in (64, 256, 2048):
            r = bench_fusions(num_tokens, copy_bw)
            results[f"fusions {num_tokens} tokens"] = r
            print(f"fusions {num_tokens} tokens", json.dumps(r), flush=True)
            for mode in ("graph", "eager"):
                fused = r[f"fused_{mode}_us"]
                rows.append((f"norm+rope+silu per layer, 8B, {num_tokens} tok, {mode}",
                             f"{fused:.1f} us", f"{r['bytes'] / fused / 1e3:.0f} GB/s, floor "
                             f"{r['floor_us']:.1f} us", f"torch twins {r[f'torch_{mode}_us']:.1f} us",
                             f"{r[f'ratio_{mode}']:.2f}x"))
    if "matmul" in only:
        r = bench_matmul()
        results["matmul"] = r
        for n, row in r.items():
            if n == "peak_tflops":
                continue
            print(f"matmul {n} tokens", json.dumps(row), flush=True)
            rows.append((f"Llama-3-8B layer matmuls, {n} tokens", f"{row['layer_ms'] * 1e3:.0f} us",
                         f"{row['layer_tflops']:.0f} TFLOP/s",
                         " ".join(f"{k} {row[k]:.0f}" for k, _, _ in MATMUL_SHAPES),
                         f"{row['layer_tflops'] / r['peak_tflops']:.2f} of 8192^3 "
                         f"({r['peak_tflops']:.0f})"))
    if "sampling" in only:
        r = bench_sampling()
        results["sampling"] = r
        for n, row in r.items():
            print(f"sampling {n} rows", json.dumps(row), flush=True)
            rows.append((f"seeded sampling, {n} x 128,256 logits, temperature 0.8",
                         f"race {row['kernel_race_us']:.0f} us (kernel); whole sample "
                         f"{row['sample_us']:.0f} us",
                         f"top-p 0.9: {row['top_p_us']:.0f} us",
                         f"torch race ops {row['torch_race_us']:.0f} us",
                         f"{row['torch_race_us'] / row['kernel_race_us']:.1f}x"))
    if args.vllm_fa3 and only & {"prefill", "decode"}:
        fa3 = run_fa3(args.vllm_fa3)
        results["vllm_fa3"] = fa3
        rows += fa3_rows(results, fa3, copy_bw)
    if "compile" in only and not args.skip_compile:
        r = compile_times()
        results["compile"] = r
        rows.append(("compile all kernels", f"cold {r['cold']['total']:.2f} s",
                     f"cached {r['cached']['total']:.2f} s", "", ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print()
    print("| workload | time | rate | baseline | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
