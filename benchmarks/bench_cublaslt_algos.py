"""Does cuBLAS's own choice leave time on the table? Llama-3-8B's layer products (and lm_head) at
M rows: F.linear (what the model runs untuned) against every algorithm cuBLASLt's heuristic
offers for the same product (pagedserve_kernels.gemm.LinearTuner.time_choices: each over 32 distinct
weight copies, no L2 reuse, as a decode step's layers, in one CUDA graph; outputs checked against
F.linear), and what choosing the fastest would save per step.

    python3 benchmarks/bench_cublaslt_algos.py [--rows 64 128 192 256] [--out FILE]

Needs CUDA and about 16 GB of GPU memory."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import MATMUL_SHAPES  # noqa: E402  (this script's folder)
from pagedserve_kernels.gemm import LinearTuner  # noqa: E402

SHAPES = (*MATMUL_SHAPES, ("lm_head", 128256, 4096))
COPIES = 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[64, 128, 192, 256])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tuner = LinearTuner(torch.device("cuda"))
    torch.manual_seed(0)
    rows, saved = [], {}
    for name, n, k in SHAPES:
        copies = 1 if name == "lm_head" else COPIES  # lm_head's 1 GB is past L2 already
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                   for _ in range(copies)]
        for m in args.rows:
            row = tuner.time_choices(name, m, weights)
            rows.append(row)
            first = row["candidates"][0]["us"] if row["candidates"] else float("nan")
            best = row["best"] or {}
            gain = max(0.0, row["linear_us"] - best.get("us", row["linear_us"]))
            saved[m] = saved.get(m, 0.0) + (1 if name == "lm_head" else 32) * gain
            print(f"{name:8s} M={m:5d}: F.linear {row['linear_us']:9.1f} us; heuristic's first "
                  f"{first:9.1f}; best of {row['algos']} {best.get('us', float('nan')):9.1f} us "
                  f"(rank {best.get('rank')}, tile {best.get('tile')}, split-k "
                  f"{best.get('splitk')})", flush=True)
        del weights
        torch.cuda.empty_cache()
    for m, us in saved.items():
        print(f"M={m}: the fastest of each product would save {us / 1e3:.3f} ms over 32 layers "
              "and lm_head", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "saved_ms": {
            m: us / 1e3 for m, us in saved.items()}}, indent=1))


if __name__ == "__main__":
    main()
