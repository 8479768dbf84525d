"""The W4A16 products after the ops kernels that precede them in a decode layer, launched plainly
and programmatically, with the ops' early `launch_dependents` (each ops kernel lets a dependent
grid start as soon as all its blocks run) kept or compiled out: where a programmatic launch gains
or loses, and whether the early start is what costs. Llama-3-8B's shapes, AWQ-like weights
(group 128, zero points), each pair in one CUDA graph over enough layers' weights that none is
read from L2:

    rms_norm -> o (4096 x 4096), rms_norm -> gate_up (28672 x 4096), silu_and_mul -> down
    (4096 x 14336)

    PYTHONPATH=. python3 benchmarks/bench_programmatic.py [--rows 4 8 16 32 64] [--no-trigger]
        [--tuned]

--no-trigger builds the ops module without the early start (its source patched in this process
only, so CuPy compiles it apart); run it beside a plain run in the same call to compare. Every
row count launches programmatically here, the 16-row tile included (the launcher's own range is
quant.PROGRAMMATIC_MIN_ROWS to PROGRAMMATIC_ROWS). --tuned tunes each shape's tiles and K parts
first (quant.tune_dequant_rows, as the executor does at load), where the launcher's defaults
serve otherwise; each row shows the kernel and K parts it ran. µs per pair: each mode timed twice, alternated
(a median of the replays each time), the lower kept.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_quant import copies_for, int4_weights  # noqa: E402  (this folder)

from pagedserve_kernels.gemm import graph_us  # noqa: E402

PAIRS = (("rms_norm -> o", 4096, 4096), ("rms_norm -> gate_up", 28672, 4096),
         ("silu_and_mul -> down", 4096, 14336))


def without_early_trigger() -> None:
    """Every module but quant's built without ps::launch_dependents (the products keep theirs)."""
    from pagedserve_kernels import _compile

    load = _compile.load_source

    def load_source(name: str) -> str:
        text = load(name)
        return text if name == "quant.cu" else text.replace("ps::launch_dependents();", ";")

    _compile.load_source = load_source


def measure(rows_list, replays: int, tuned: bool = False) -> dict:
    from pagedserve_kernels import ops, quant

    dev = torch.device("cuda")
    quant.prepare(dev, max(n * k for _, n, k in PAIRS) if tuned else 0, torch.bfloat16)
    quant.PROGRAMMATIC_MIN_ROWS = 1  # the 16-row tile too
    out = {}
    for name, n, k in PAIRS:
        weights = int4_weights(n, k, 128, True, copies_for(n * k // 2))
        if tuned:  # the shape's tiles and K parts as the executor tunes them at load
            quant.tune_dequant_rows(weights, dev, rows_list=tuple(r for r in rows_list if r > 32))
        for rows in rows_list:
            # the ops kernel's input: hidden rows for a norm, gate | up rows for silu_and_mul
            width = 2 * k if name.startswith("silu") else k
            src = torch.randn(rows, width, dtype=torch.bfloat16, device=dev)
            norm_w = torch.ones(k, dtype=torch.bfloat16, device=dev)
            x = torch.empty(rows, k, dtype=torch.bfloat16, device=dev)
            y = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)

            def pairs():
                for w in weights:
                    if name.startswith("silu"):
                        ops.silu_and_mul(src, out=x)
                    else:
                        ops.rms_norm(src, norm_w, 1e-5, out=x)
                    quant._kernel_product(x, w, None, y)

            timed = {}
            for mode in (False, True, False, True):  # alternated: drift shows as spread
                assert quant.set_programmatic(dev, mode) == mode, "no programmatic launches here"
                timed.setdefault(mode, []).append(graph_us(pairs, replays) / len(weights))
            kernel, _, _, splits, _ = quant.launch_shape(rows, weights[0], dev, torch.bfloat16)
            out[f"{name} {rows}"] = {"plain_us": min(timed[False]),
                                     "programmatic_us": min(timed[True]), "kernel": kernel,
                                     "splits": splits}
            r = out[f"{name} {rows}"]
            print(f"| {name} | {rows} | {kernel}, {splits} K parts | {r['plain_us']:.1f} | "
                  f"{r['programmatic_us']:.1f} | {r['programmatic_us'] / r['plain_us']:.2f}x |",
                  flush=True)
        del weights
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--no-trigger", action="store_true",
                   help="the ops kernels built without their early launch_dependents")
    p.add_argument("--tuned", action="store_true",
                   help="each shape's tiles and K parts tuned first, as the executor does")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.no_trigger:
        without_early_trigger()
    torch.manual_seed(0)
    print(f"ops' early start: {'compiled out' if args.no_trigger else 'kept'}")
    print(f"tiles and K parts: {'tuned' if args.tuned else 'the launcher defaults'}")
    print("| pair | rows | kernel | plain µs | programmatic µs | programmatic / plain |")
    print("|---|---|---|---|---|---|")
    results = measure(args.rows, args.replays, args.tuned)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
