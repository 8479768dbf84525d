"""Where one decode step of the W1 model goes: a CUDA-graph replay of the executor's forward
(embedding to float32 logits) for a batch of sequences mid-generation, timed with and without the
fused elementwise kernels, the kernels of one eager step grouped by kind, and those of a replay by
kind and name with the device's idle time between them (torch profiler).
With --mixed N, also a mixed step as the executor runs it eagerly (the decodes plus one N-token
prompt chunk): its host launch time, GPU time and kernels by kind. With --chunk N --cached C, a
step of one seq's N new tokens over C cached ones (a chat turn whose prefix is cached) through
a small-step graph, its attention through the few-query kernel (at its split size, at 256-key
splits, and the key-split candidate) and through the prefill kernel, beside a one-token decode
step of the same seq; with --decodes D, the chunk beside D one-token seqs (a mixed small step):

    PYTHONPATH=. python3 benchmarks/profile_decode.py --skip-decode --batch --chunk 16 --cached 2000
    PYTHONPATH=. python3 benchmarks/profile_decode.py --skip-decode --batch --chunk 8 32 \
        --decodes 8 24 --cached 2000

    PYTHONPATH=. python3 benchmarks/profile_decode.py --out decode_profile.json
    PYTHONPATH=. python3 benchmarks/profile_decode.py --batch 256 --mixed 1077 --skip-decode
    PYTHONPATH=. python3 benchmarks/profile_decode.py --batch 128 --mixed 544 --skip-decode \
        --variants fused piecewise    (eager against the piecewise graphs, same step)

The model is prepared as the executor prepares it before serving (int4 weights repacked and their
tiles tuned, GEMM algorithms chosen), so `--model` may be a quantized folder (AWQ, GPTQ, FP8):

    PYTHONPATH=. python3 benchmarks/profile_decode.py --model /tmp/qawq/pagedserve-llama3-8b-awq \
        --batch 128 256 512

Floor printed beside it: weights + this batch's K/V read once at the copy bandwidth measured in the
same run. GPU only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.attention_metadata import AttentionMetadata  # noqa: E402
from executor_svc.backends.cuda import CudaBackend  # noqa: E402
from executor_svc.cache_engine import CacheEngine  # noqa: E402
from executor_svc.cuda_graphs import BATCH_SIZES  # noqa: E402
from executor_svc.model_loader import load_model  # noqa: E402
from executor_svc.piecewise_graphs import PiecewiseGraphs  # noqa: E402
from pagedserve_kernels import quant  # noqa: E402

from bench_kernels import copy_bandwidth, median_ms  # noqa: E402  (this script's folder)

_LAUNCHER_MIN_ROWS = quant.PROGRAMMATIC_MIN_ROWS  # where the launcher starts programmatic launches

BLOCK_SIZE = 16
KINDS = (  # (kind, substrings of kernel names), first match wins
    ("attention", ("decode_", "prefill_", "query_tiles")),
    ("cache write", ("reshape_and_cache",)),
    ("fused elementwise", ("rms_norm", "rotary", "silu_and_mul", "quantize_fp8")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "splitk", "sm90", "w4a16")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other (torch)")


class DecodeStep:
    """Static inputs for `batch` sequences with the given context lengths, and a captured graph."""

    def __init__(self, model, kv_caches, context_lens: list[int], width: int) -> None:
        self.model, self.kv_caches = model, kv_caches
        n = len(context_lens)
        pages = [-(-length // BLOCK_SIZE) for length in context_lens]
        perm = torch.randperm(sum(pages), dtype=torch.int32)  # pages in shuffled order
        tables = torch.zeros(n, width, dtype=torch.int32)  # columns past a row's pages: unread
        used = 0
        for row, count in enumerate(pages):
            tables[row, :count] = perm[used:used + count]
            used += count
        positions = torch.tensor(context_lens, dtype=torch.int64) - 1
        slots = tables.long().gather(1, (positions // BLOCK_SIZE).view(-1, 1)).view(-1)
        slots = slots * BLOCK_SIZE + positions % BLOCK_SIZE
        self.input_ids = torch.randint(1, model.config.vocab_size, (n,), device="cuda")
        self.positions = positions.cuda()
        self.md = AttentionMetadata(
            slot_mapping=slots.cuda(), block_tables=tables.cuda(),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device="cuda"),
            max_seqlen_q=1, max_seqlen_k=width * BLOCK_SIZE, is_decode_only=True)
        self.graph = None

    def forward(self) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids, self.positions, self.md, self.kv_caches)
        return self.model.compute_logits(hidden)

    def capture(self) -> None:
        self.forward()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.forward()
        torch.cuda.synchronize()

    def replay_ms(self, iters: int = 30) -> float:
        return median_ms(lambda i: self.graph.replay(), iters=iters)


class MixedStep:
    """A mixed step as the runner builds it: `context_lens` one-token seqs first, then new
    prompts of `prompts` tokens each (from position 0), metadata from build_attention_metadata;
    run eagerly, or with `piecewise` through PiecewiseGraphs captured at the executor's ladder
    size for it (attention eagerly between the pieces)."""

    def __init__(self, model, kv_caches, context_lens: list[int], prompts: list[int],
                 piecewise: bool = False) -> None:
        from executor_svc.attention_metadata import build_attention_metadata

        self.model, self.kv_caches = model, kv_caches
        lens = context_lens + prompts
        pages = [-(-length // BLOCK_SIZE) for length in lens]
        perm = torch.randperm(sum(pages)).tolist()  # pages in shuffled order
        tables, used = [], 0
        for count in pages:
            tables.append(perm[used:used + count])
            used += count
        self.build = lambda: build_attention_metadata(
            tables, [n - 1 for n in context_lens] + [0] * len(prompts),
            [1] * len(context_lens) + prompts, BLOCK_SIZE, torch.device("cuda"))
        self.positions, self.md = self.build()
        num_tokens = len(context_lens) + sum(prompts)
        self.input_ids = torch.randint(1, model.config.vocab_size, (num_tokens,), device="cuda")
        ends = np.cumsum([1] * len(context_lens) + prompts) - 1
        self.sample_rows = torch.tensor(ends, device="cuda")  # [num_seqs]: the rows sampled
        self.pieces = None
        if piecewise:
            size = next((s for s in BATCH_SIZES if s >= num_tokens), num_tokens)
            self.pieces = PiecewiseGraphs(model, kv_caches, (size,))
            self.pieces.capture(torch.cuda.graph_pool_handle())

    def forward(self) -> torch.Tensor:
        self.positions, self.md = self.build()  # timed too: the runner builds it every step
        if self.pieces is not None:
            hidden = self.pieces.forward(self.input_ids, self.positions, self.md)
        else:
            hidden = self.model.forward(self.input_ids, self.positions, self.md, self.kv_caches)
        return self.model.compute_logits(hidden[self.sample_rows])

    def timed(self, iters: int = 10) -> dict:
        """Host launch and GPU time of one eager step (median over iters, GPU idle at start)."""
        host, gpu = [], []
        with torch.inference_mode():
            for _ in range(iters + 2):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                self.forward()
                end.record()
                host.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                gpu.append(start.elapsed_time(end))
        host, gpu = sorted(host[2:]), sorted(gpu[2:])
        return {"host_launch_ms": host[len(host) // 2], "gpu_ms": gpu[len(gpu) // 2]}


def eager_breakdown(step) -> dict:
    """GPU time of one eager step by kernel kind (ms) and its kernel count."""
    with torch.inference_mode():
        return kernel_breakdown(step.forward, warmup=1, iters=1)


def kernel_breakdown(fn, warmup: int = 3, iters: int = 10) -> dict:
    """GPU time per call of fn by kernel kind (ms), the attention kernels' by name, and kernels
    per call, over `iters` calls (torch profiler) after `warmup` untimed ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict = {}
    attention: dict = {}
    by_name: dict = {}
    count = 0
    spans = []  # (start us, end us, name) of every kernel and copy on the device
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        count += 1
        spans.append((evt.time_range.start, evt.time_range.end, evt.name))
        kind, ms = kind_of(evt.name), evt.time_range.elapsed_us() / 1e3 / iters
        totals[kind] = totals.get(kind, 0.0) + ms
        by_name[evt.name] = by_name.get(evt.name, 0.0) + ms
        if kind == "attention":
            attention[evt.name] = attention.get(evt.name, 0.0) + ms
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:16])
    return {"ms_by_kind": totals, "attention_ms_by_kernel": attention, "kernels": count // iters,
            "top_kernels_ms": top, **_idle(spans, iters)}


def _idle(spans: list[tuple[float, float, str]], iters: int) -> dict:
    """Where the device ran nothing while the calls' work was queued: the idle time between
    consecutive kernels per call (ms), and the largest such gaps (µs, with the kernels either
    side)."""
    spans.sort()
    gaps, end, before = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            end, before = stop, name
    gaps.sort(key=lambda g: -g[0])
    return {"idle_between_kernels_ms": sum(g[0] for g in gaps) / 1e3 / iters,
            "largest_gaps_us": [(round(g, 1), a[:60], b[:60]) for g, a, b in gaps[:12]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:llama3-8b")
    p.add_argument("--batch", type=int, nargs="*", default=[64, 256])
    p.add_argument("--context", type=int, nargs=2, default=[64, 1536],
                   help="context lengths drawn uniformly in this range")
    p.add_argument("--mixed", type=int, nargs="*", default=[],
                   help="also profile mixed steps: each batch's decodes plus one prompt chunk of "
                        "this many tokens (the executor's eager path)")
    p.add_argument("--prompts", type=int, nargs="*", default=[],
                   help="also profile steps of this many prompt tokens from new prompts of W1's "
                        "lengths (64-1,024, the last one cut), beside each batch's decodes "
                        "(--batch 0: none): W1's prefill steps")
    p.add_argument("--skip-decode", action="store_true", help="only the mixed steps")
    p.add_argument("--chunk", type=int, nargs="*", default=[],
                   help="also time a step of this many new tokens of one seq over --cached "
                        "cached ones through a small-step graph, each attention path (one per N)")
    p.add_argument("--cached", type=int, default=2000)
    p.add_argument("--decodes", type=int, nargs="*", default=[0],
                   help="with --chunk: also each chunk beside this many one-token seqs "
                        "(a mixed small step)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="variants, each captured and timed (default: fused and unfused for decode "
                        "steps, fused for mixed and prompt steps): fused (the fused kernels; "
                        "mixed and prompt steps eagerly), unfused (torch's elementwise ops), "
                        "rope-cache-apart (as fused but RoPE and the cache write as two "
                        "launches), piecewise (mixed and prompt steps through the piecewise "
                        "graphs, as the executor serves steps up to their ceiling), "
                        "plain-launches (as fused, the W4A16 products launched plainly), "
                        "all-programmatic (as fused, the 16-row W4A16 tile launched "
                        "programmatically too)")
    p.add_argument("--rounds", type=int, default=1, help="time the variants in turn this often")
    p.add_argument("--gemm-cache", help="keep the GEMM choices here (the executor's "
                   "--fingerprint-cache-dir); default: chosen again each run")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    backend = CudaBackend()
    model, config, _, _ = load_model(args.model, torch.bfloat16, backend.device, 0, backend)
    # as the executor does before it serves: int4 weights repacked and their tiles tuned, the
    # dense products' GEMM algorithms chosen
    backend.prepare_model(model, args.gemm_cache, 8192)
    width = 4096 // BLOCK_SIZE  # the executor's graph width at max_model_len 4096
    rng = random.Random(0)
    lens_of = {batch: [rng.randint(*args.context) for _ in range(batch)] for batch in args.batch}
    num_blocks = max((sum(-(-n // BLOCK_SIZE) for n in lens) for lens in lens_of.values()),
                     default=0)
    num_blocks += -(-max(args.mixed, default=0) // BLOCK_SIZE)
    num_blocks += sum(-(-n // BLOCK_SIZE) + 1 for n in w1_prompts(max(args.prompts, default=0)))
    num_blocks += -(-(args.cached + max(args.chunk, default=0)) // BLOCK_SIZE)
    num_blocks += max(args.decodes, default=0) * -(-2 * args.cached // BLOCK_SIZE)
    engine = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                         num_blocks, 0, torch.bfloat16, backend)
    copy_bw = copy_bandwidth()
    weight_bytes = sum(t.numel() * t.element_size() for t in _weights(model))
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    results = {"gpu": torch.cuda.get_device_name(0), "copy_bw_GBps": copy_bw / 1e9,
               "weight_GB": weight_bytes / 1e9, "batches": {}}
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB", flush=True)
    rows = []
    for batch in args.batch:
        lens = lens_of[batch]
        floor_ms = (weight_bytes + sum(lens) * kv_token_bytes) / copy_bw * 1e3
        entry = {"context_tokens": sum(lens), "floor_ms": floor_ms}
        for prompts in [[n] for n in args.mixed] + [w1_prompts(n) for n in args.prompts]:
            for round_ in range(args.rounds):
                for label in args.variants or ["fused"]:
                    set_variant(backend, label)
                    rows.append(profile_mixed(model, engine, lens, prompts, weight_bytes,
                                              copy_bw, entry, run_name(label, round_, args.rounds)))
        set_variant(backend, "fused")
        if args.skip_decode or batch == 0:  # batch 0: prompt steps alone
            results["batches"][batch] = entry
            continue
        step = DecodeStep(model, engine.kv_caches, lens, width)
        for round_ in range(args.rounds):
            for label in args.variants or ["fused", "unfused"]:
                if label == "piecewise":  # decode steps replay whole-step graphs
                    continue
                set_variant(backend, label)
                with torch.inference_mode():
                    step.capture()
                e = {"replay_ms": step.replay_ms(), **eager_breakdown(step),
                     "replay_kernels": kernel_breakdown(step.graph.replay)}
                step.graph = None
                torch.cuda.synchronize()
                name = run_name(label, round_, args.rounds)
                entry[name] = e
                print(f"batch {batch} {name}: replay {e['replay_ms']:.3f} ms (floor "
                      f"{floor_ms:.2f}); eager kernels {e['kernels']}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(e["ms_by_kind"].items())),
                      flush=True)
                replayed = e["replay_kernels"]
                print("  replayed: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in sorted(replayed["ms_by_kind"].items()))
                    + f"; idle between kernels {replayed['idle_between_kernels_ms']:.3f} ms",
                    flush=True)
                for kernel, ms in replayed["top_kernels_ms"].items():
                    print(f"    {ms:8.3f} ms  {kernel[:150]}", flush=True)
                rows.append((f"batch {batch}, {name}", f"{e['replay_ms']:.3f} ms",
                             f"{floor_ms:.2f} ms", f"{100 * floor_ms / e['replay_ms']:.0f}%",
                             str(e["kernels"])))
        set_variant(backend, "fused")
        results["batches"][batch] = entry
    results["chunks"] = [profile_chunk(model, engine, chunk, args.cached, width,
                                       weight_bytes / copy_bw * 1e3, decodes)
                         for decodes in args.decodes for chunk in args.chunk]
    print("\n| decode step (graph replay) | time | floor | floor/time | kernels per eager step |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def w1_prompts(num_tokens: int) -> list[int]:
    """Prompt lengths drawn as W1's (64-1,024) until they hold num_tokens, the last one cut."""
    rng, prompts = random.Random(1), []
    while sum(prompts) < num_tokens:
        prompts.append(min(rng.randint(64, 1024), num_tokens - sum(prompts)))
    return prompts


VARIANTS = ("fused", "unfused", "rope-cache-apart", "piecewise", "plain-launches",
            "all-programmatic")
_PROGRAMMATIC: dict = {}  # device index -> whether prepare_model left the int4 launches programmatic


def run_name(label: str, round_: int, rounds: int) -> str:
    return label if rounds == 1 else f"{label}, round {round_ + 1}"


def set_variant(backend, label: str) -> None:
    """Sets the backend up as the decode-step variant `label` (VARIANTS)."""
    backend.fused_ops = label != "unfused"
    # plain-launches: as fused, with the W4A16 products launched plainly (a quantized model)
    index = backend.device.index
    on = _PROGRAMMATIC.setdefault(index, quant.launches_programmatically(backend.device))
    if on:
        quant.set_programmatic(backend.device, label != "plain-launches")
    # all-programmatic: as fused, the 16-row tile launched programmatically too
    quant.PROGRAMMATIC_MIN_ROWS = 1 if label == "all-programmatic" else _LAUNCHER_MIN_ROWS
    if label == "rope-cache-apart":
        def apart(positions, q, k, value, cos, sin, k_cache, v_cache, slots, interleaved=False,
                  k_scale=None, v_scale=None):
            backend.rotary_embedding(positions, q, k, cos, sin, interleaved)
            backend.reshape_and_cache(k, value, k_cache, v_cache, slots, k_scale, v_scale)
        backend.rotary_embedding_and_cache = apart
    else:
        vars(backend).pop("rotary_embedding_and_cache", None)  # the class's method again


def profile_mixed(model, engine, lens, prompts, weight_bytes, copy_bw, entry,
                  label: str = "fused") -> tuple:
    """Times and profiles one mixed step; returns its table row. Floor: the matrix products of
    every token at the matmul rate measured here, plus the decodes' K/V read once."""
    piecewise = label.split(",")[0] == "piecewise"
    step = MixedStep(model, engine.kv_caches, lens, prompts, piecewise)
    prefill = sum(prompts)
    timing = {**step.timed(), **eager_breakdown(step)}
    num_tokens = len(lens) + prefill
    flops = 2 * num_tokens * (weight_bytes / 2 - model.lm_head.numel()) \
        + 2 * (len(lens) + len(prompts)) * model.lm_head.numel()
    rate = matmul_rate()
    floor_ms = flops / rate * 1e3 + sum(lens) * _kv_token_bytes(model) / copy_bw * 1e3
    timing.update(floor_ms=floor_ms, matmul_tflops=rate / 1e12)
    entry[f"mixed {prefill}" + (f" in {len(prompts)} prompts" if len(prompts) > 1 else "")
          + f" ({label})"] = timing
    print(f"mixed step ({label}): {len(lens)} decodes + {prefill} prompt tokens "
          f"({len(prompts)} prompts): "
          f"host launch "
          f"{timing['host_launch_ms']:.2f} ms, GPU {timing['gpu_ms']:.2f} ms (floor {floor_ms:.2f} "
          f"at {rate / 1e12:.0f} TFLOP/s); kernels {timing['kernels']}: "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(timing["ms_by_kind"].items())), flush=True)
    for name, ms in timing["top_kernels_ms"].items():
        print(f"    {ms:8.3f} ms  {name[:150]}", flush=True)
    print(f"  idle between kernels {timing['idle_between_kernels_ms']:.2f} ms; largest gaps "
          f"(µs, kernel before -> after): {timing['largest_gaps_us']}", flush=True)
    return (f"mixed ({label}): {len(lens)} decodes + {prefill} prompt tokens in "
            f"{len(prompts)}, " + ("piecewise graphs" if piecewise else "eager"),
            f"{timing['gpu_ms']:.2f} ms (host {timing['host_launch_ms']:.2f})",
            f"{floor_ms:.2f} ms", f"{100 * floor_ms / timing['gpu_ms']:.0f}%",
            str(timing["kernels"]))


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n matmul on this GPU (median of 10)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n ** 3 / (median_ms(lambda i: a @ b, iters=10) / 1e3)


def _kv_token_bytes(model) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2


def _weights(model) -> list[torch.Tensor]:
    tensors = [model.norm, model.lm_head]  # of the embedding only the batch's rows are read
    for layer in model.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif dataclasses.is_dataclass(value):  # a quantized linear's tensors (int4, FP8)
                tensors += [t for t in vars(value).values() if isinstance(t, torch.Tensor)]
    return tensors



def profile_chunk(model, engine, chunk: int, cached: int, width: int, weights_ms: float,
                  decodes: int = 0) -> dict:
    """GPU time of one step of `chunk` new tokens of one seq over `cached` cached ones, beside
    `decodes` one-token seqs (contexts of `cached` + 1 to 2 x `cached`: a mixed small step),
    through a small-step graph (inputs packed, copied and the graph replayed, as the runner does),
    with attention through the few-query kernel (as configured, at 256-key splits, and the
    key-split candidate, through backend.few_query_variant) and through the prefill kernel; and
    of one decode step of the same seqs (one token each), for comparison. Median of 50 (ms),
    and each one's kernel time by kind (torch profiler, mean of 10). Figures: RESULTS.md."""
    from executor_svc.cuda_graphs import CudaGraphs, GraphInputs

    rng = np.random.default_rng(0)
    # (new tokens, cached tokens) per seq: the decodes first, as the scheduler orders them
    seqs = [(1, int(c)) for c in rng.integers(cached, 2 * cached, decodes)] + [(chunk, cached)]
    perm = torch.randperm(engine.kv_caches[0].shape[1]).numpy()
    table = np.zeros((len(seqs), width), dtype=np.int64)
    positions, slots, used = [], [], 0
    for row, (new, old) in enumerate(seqs):
        count = -(-(old + new) // BLOCK_SIZE)
        table[row, :count] = perm[used:used + count]
        used += count
        pos = np.arange(old, old + new)
        positions.append(pos)
        slots.append(table[row, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    positions, slots = np.concatenate(positions), np.concatenate(slots)
    num_tokens = len(positions)
    ids = rng.integers(1, model.config.vocab_size, num_tokens)
    cu = np.concatenate([[0], np.cumsum([new for new, _ in seqs])])
    seq_lens = np.array([new + old for new, old in seqs])
    last_rows = cu[1:] - 1
    out = {"chunk": chunk, "cached": cached, "decodes": decodes, "weights_read_ms": weights_ms}
    size = next(n for n in (16, 32, 64, 128, 256, 512) if n >= num_tokens)
    backend = model.backend
    default_max = backend.few_query_max
    variants = {  # label: (few_query_max, paged_few_query_attention's candidate keywords)
        "few_query": (size, {}), "few_query_256": (size, {"split_keys": 256}),
        "few_query_ks": (size, {"key_split": True}), "prefill_kernel": (0, {})}
    for label, (few_query_max, few_query_variant) in variants.items():
        backend.few_query_max, backend.few_query_variant = few_query_max, few_query_variant
        graphs = CudaGraphs(model, engine.kv_caches, width, batch_sizes=(), token_sizes=(size,))
        graphs.capture(None)
        inputs = GraphInputs(ids, positions, slots, seq_lens, table, cu, last_rows)
        run = lambda i: graphs.run(inputs)  # noqa: E731
        out[label] = median_ms(run, iters=50)
        kernels = kernel_breakdown(lambda: run(0))
        out[f"{label}_ms_by_kind"] = kernels["ms_by_kind"]
        out[f"{label}_attention_ms_by_kernel"] = kernels["attention_ms_by_kernel"]
        del graphs
    backend.few_query_max, backend.few_query_variant = default_max, {}
    step = DecodeStep(model, engine.kv_caches, list(seq_lens), width)
    with torch.inference_mode():
        step.capture()
    out["one_token_decode"] = step.replay_ms(iters=50)
    kernels = kernel_breakdown(step.graph.replay)
    out["one_token_decode_ms_by_kind"] = kernels["ms_by_kind"]
    out["one_token_decode_attention_ms_by_kernel"] = kernels["attention_ms_by_kernel"]
    beside = f" beside {decodes} decodes" if decodes else ""
    print(f"{chunk} new tokens over {cached} cached{beside} (small-step graph of {size}): "
          f"few-query kernel {out['few_query']:.2f} ms (256-key splits "
          f"{out['few_query_256']:.2f}, key split {out['few_query_ks']:.2f}), prefill kernel "
          f"{out['prefill_kernel']:.2f} ms; a one-token decode step of the same seqs "
          f"{out['one_token_decode']:.2f} ms; weights read at the copy rate {weights_ms:.2f} ms",
          flush=True)
    for label in (*variants, "one_token_decode"):
        print(f"  {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                         sorted(out[f"{label}_ms_by_kind"].items()))
              + "; attention: " + ", ".join(
                  f"{k} {v:.3f}" for k, v in
                  sorted(out[f"{label}_attention_ms_by_kernel"].items())), flush=True)
    return out


if __name__ == "__main__":
    main()
