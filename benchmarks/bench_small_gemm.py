"""The small-M product of our own (kernels.small_gemm) against cuBLAS at decode batch sizes:
Llama-3-8B's layer products and lm_head at M rows, each timed inside a CUDA graph over 32
distinct weight copies (no L2 reuse, as a decode step's layers; lm_head one 1 GB weight): F.linear,
the fastest cuBLASLt algorithm of the heuristic's (kernels.gemm.LinearTuner.time_choices), and
small_linear at each split count of --splits (its outputs checked against F.linear first). Prints
µs per product, the weights' read rate, and per decode step (32 layers and lm_head) what the
fastest of ours would save against the faster of cuBLAS's two.

    python3 benchmarks/bench_small_gemm.py [--rows 1 16 32 64 96 128] [--out FILE]

Needs an H200/H100 (sm_90) and about 16 GB of GPU memory."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import MATMUL_SHAPES  # noqa: E402  (this script's folder)
from kernels import small_gemm  # noqa: E402
from kernels.gemm import LinearTuner, graph_us  # noqa: E402

SHAPES = (*MATMUL_SHAPES, ("lm_head", 128256, 4096))
COPIES = 32
REPLAYS = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 16, 32, 64, 96, 128])
    p.add_argument("--splits", type=int, nargs="*", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    tuner = LinearTuner(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ws = small_gemm.SmallGemmWorkspace(device, 128256 // small_gemm.TILE_ROWS,
                                       max(args.splits + [16]))
    torch.manual_seed(0)
    rows, saved = [], {}
    for name, n, k in SHAPES:
        copies = 1 if name == "lm_head" else COPIES
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02
                   for _ in range(copies)]
        calls = weights * -(-4 // len(weights))
        for m in args.rows:
            row = tuner.time_choices(name, m, weights)
            lt_us = (row["best"] or {}).get("us", float("inf"))
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            ref = F.linear(x, weights[0]).float()
            scale = float(ref.abs().max()) or 1.0
            ours = {}
            for splits in sorted(set(args.splits) | {small_gemm.default_splits(n, k, sms)}):
                if splits > k // small_gemm.CHUNK or (splits > 1 and splits > ws.max_splits):
                    continue
                small_gemm.small_linear(x, weights[0], out, splits=splits, workspace=ws)
                err = float((out.float() - ref).abs().max()) / scale
                if err > 2e-2:
                    print(f"{name} M={m} splits={splits}: WRONG (max error {err:.2e} of the "
                          "output's scale)", flush=True)
                    continue
                ours[splits] = graph_us(lambda: [small_gemm.small_linear(
                    x, w, out, splits=splits, workspace=ws) for w in calls], REPLAYS) / len(calls)
            best_splits = min(ours, key=ours.get) if ours else None
            best = ours.get(best_splits, float("inf"))
            cublas = min(row["linear_us"], lt_us)
            gbps = n * k * 2 / (best * 1e-6) / 1e9 if ours else 0.0
            print(f"{name:8s} M={m:4d}: F.linear {row['linear_us']:8.1f} us, cuBLASLt best "
                  f"{lt_us:8.1f}; ours " + ", ".join(f"{s}: {us:.1f}" for s, us in ours.items())
                  + f" -> best {best:.1f} us at {best_splits} splits ({gbps:,.0f} GB/s), "
                  f"{cublas / best:.2f}x cuBLAS's best", flush=True)
            rows.append({"product": name, "m": m, "n": n, "k": k, "linear_us": row["linear_us"],
                         "cublaslt_best_us": lt_us, "ours_us": ours, "ours_best_splits": best_splits,
                         "default_splits": small_gemm.default_splits(n, k, sms)})
            per_step = 1 if name == "lm_head" else 32
            saved[m] = saved.get(m, 0.0) + per_step * max(0.0, cublas - best)
        del weights, calls
        torch.cuda.empty_cache()
    for m, us in saved.items():
        print(f"M={m}: ours where faster would save {us / 1e3:.3f} ms per decode step (32 layers "
              "and lm_head) against the faster of F.linear and cuBLASLt's best", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "saved_ms": {
            m: us / 1e3 for m, us in saved.items()}}, indent=1))


if __name__ == "__main__":
    main()
