"""Where one decode step of the W1 model goes: a CUDA-graph replay of the executor's forward
(embedding to float32 logits) for a batch of sequences mid-generation, timed with and without the
fused elementwise kernels, and the kernels of one eager step grouped by kind (torch profiler).

    PYTHONPATH=. python3 benchmarks/profile_decode.py --out decode_profile.json

Floor printed beside it: weights + this batch's K/V read once at the copy bandwidth measured in the
same run. GPU only.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.attention_metadata import AttentionMetadata  # noqa: E402
from executor_svc.backends.cuda import CudaBackend  # noqa: E402
from executor_svc.cache_engine import CacheEngine  # noqa: E402
from executor_svc.model_loader import load_model  # noqa: E402

from bench_kernels import copy_bandwidth, median_ms  # noqa: E402  (this script's folder)

BLOCK_SIZE = 16
KINDS = (  # (kind, substrings of kernel names), first match wins
    ("attention", ("decode_",)),
    ("cache write", ("reshape_and_cache",)),
    ("fused elementwise", ("rms_norm", "rotary", "silu_and_mul")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "splitk", "sm90")),
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


def eager_breakdown(step: DecodeStep) -> dict:
    """GPU time of one eager step by kernel kind (ms) and its kernel count."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        step.forward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step.forward()
            torch.cuda.synchronize()
    totals: dict = {}
    count = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        count += 1
        kind = kind_of(evt.name)
        totals[kind] = totals.get(kind, 0.0) + evt.time_range.elapsed_us() / 1e3
    return {"ms_by_kind": totals, "kernels": count}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:llama3-8b")
    p.add_argument("--batch", type=int, nargs="*", default=[64, 256])
    p.add_argument("--context", type=int, nargs=2, default=[64, 1536],
                   help="context lengths drawn uniformly in this range")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    backend = CudaBackend()
    model, config, _, _ = load_model(args.model, torch.bfloat16, backend.device, 0, backend)
    width = 4096 // BLOCK_SIZE  # the executor's graph width at max_model_len 4096
    rng = random.Random(0)
    lens_of = {batch: [rng.randint(*args.context) for _ in range(batch)] for batch in args.batch}
    num_blocks = max(sum(-(-n // BLOCK_SIZE) for n in lens) for lens in lens_of.values())
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
        step = DecodeStep(model, engine.kv_caches, lens, width)
        for fused in (True, False):
            backend.fused_ops = fused
            with torch.inference_mode():
                step.capture()
            label = "fused" if fused else "unfused"
            entry[label] = {"replay_ms": step.replay_ms(), **eager_breakdown(step)}
            step.graph = None
            torch.cuda.synchronize()
            e = entry[label]
            print(f"batch {batch} {label}: replay {e['replay_ms']:.2f} ms (floor {floor_ms:.2f}); "
                  f"eager kernels {e['kernels']}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(e["ms_by_kind"].items())), flush=True)
            rows.append((f"batch {batch}, {label}", f"{e['replay_ms']:.2f} ms", f"{floor_ms:.2f} ms",
                         f"{100 * floor_ms / e['replay_ms']:.0f}%", str(e["kernels"])))
        backend.fused_ops = True
        results["batches"][batch] = entry
    print("\n| decode step (graph replay) | time | floor | floor/time | kernels per eager step |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def _weights(model) -> list[torch.Tensor]:
    tensors = [model.norm, model.lm_head]  # of the embedding only the batch's rows are read
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return tensors


if __name__ == "__main__":
    main()
