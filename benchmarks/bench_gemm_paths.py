"""Llama-3-8B's four layer products through each cuBLAS path torch offers, at decode and
prefill row counts: F.linear on [out, in] weights (what the model runs) or torch.mm on
[in, out] copies, with torch's default BLAS library or cuBLASLt preferred. 32 layers of distinct
weights (14 GB, no L2 reuse) in one CUDA graph per (path, rows) (bench_kernels.graph_ms);
median of 10 replays.

    python3 benchmarks/bench_gemm_paths.py [ROWS ...]

Needs CUDA and about 30 GB of GPU memory (both weight layouts)."""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench_kernels import MATMUL_SHAPES as SHAPES, graph_ms  # (this script's folder)

LAYERS = 32
ROWS = (16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)
PATHS = ("linear", "mm_transposed", "linear_lt", "mm_transposed_lt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", type=int, nargs="*", default=list(ROWS))
    args = p.parse_args()
    torch.manual_seed(0)
    default_lib = str(torch.backends.cuda.preferred_blas_library()).split(".")[-1].lower()
    weights = [{n: torch.randn(m, k, dtype=torch.bfloat16, device="cuda") * 0.02
                for n, m, k in SHAPES} for _ in range(LAYERS)]  # [out, in]
    transposed = [{n: w.t().contiguous() for n, w in layer.items()} for layer in weights]
    flops_per_row = 2 * LAYERS * sum(m * k for _, m, k in SHAPES)
    weight_bytes = 2 * LAYERS * sum(m * k for _, m, k in SHAPES)

    def stack(x: dict, path: str) -> None:
        for layer in range(LAYERS):
            for n, _, _ in SHAPES:
                if path.startswith("mm_transposed"):
                    torch.mm(x[n], transposed[layer][n])
                else:
                    F.linear(x[n], weights[layer][n])

    def time_path(rows: int, path: str) -> float:
        torch.backends.cuda.preferred_blas_library("cublaslt" if path.endswith("_lt")
                                                   else default_lib)
        x = {n: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for n, _, k in SHAPES}
        ms = graph_ms(lambda: stack(x, path), calls=1, replays=10)
        torch.backends.cuda.preferred_blas_library(default_lib)
        return ms

    print(f"default BLAS library: {default_lib}; weights {weight_bytes / 1e9:.1f} GB")
    print("| rows | " + " | ".join(f"{path} ms" for path in PATHS) + " | best | linear TFLOP/s |")
    print("|---" * (len(PATHS) + 3) + "|")
    for rows in args.rows:
        ms = {path: time_path(rows, path) for path in PATHS}
        best = min(ms, key=ms.get)
        print(f"| {rows} | " + " | ".join(f"{ms[path]:.3f}" for path in PATHS)
              + f" | {best} | {flops_per_row * rows / ms['linear'] / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
