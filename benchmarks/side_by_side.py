"""pagedserve and vLLM on the same GPU in one run: W1, W2, W3 (BENCHMARK.md) through
`bench_serving.py` (both services, the public gRPC API) and through vLLM's offline `LLM.generate`
with its defaults (`offline_bench.py` of ../shared/bench/vllm, installed by its install_on_gpu.sh),
then the GPU's ceilings (bf16 matmul rate, copy bandwidth) and the ratio table.

    python3 benchmarks/side_by_side.py --workloads W1,W2,W3 --out-dir $OUT

On the GPU machine, after the three staging calls of ../shared/bench/vllm/README.md, in the call
that brings .vllm04: `bash .vllm04/install_on_gpu.sh && python3 benchmarks/side_by_side.py ...`.
The same requests on both sides (lengths from random.Random(0), ids from random.Random(1), EOS
ignored, every request its full output). Runs one after the other, pagedserve first; each side
gets the whole GPU. The floor is a bound from the measured ceilings, not a reachable rate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import WORKLOADS, make_requests  # noqa: E402  (this script's folder)

# Llama-3-8B (BENCHMARK.md), the model both sides run with random bf16 weights.
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
LAYER_PARAMS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN \
    + 3 * HIDDEN * INTER
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16


def floor_seconds(workload: str, matmul_flops: float, copy_bps: float) -> float:
    """A lower bound on a workload's time: every row's matrix products at the measured matmul
    rate, causal prefill attention at that rate too, and each decode row's K/V read once at the
    copy bandwidth. Weights re-read per step, sampling and everything else count as zero."""
    flops = kv_bytes = 0.0
    for prompt, output in make_requests(workload, VOCAB):
        p, rows = len(prompt), len(prompt) + output - 1
        flops += 2 * rows * LAYERS * LAYER_PARAMS + 2 * output * HIDDEN * VOCAB
        flops += 4 * LAYERS * HEADS * HEAD_DIM * p * (p + 1) / 2  # QK^T and PV, causal
        contexts = output * p + output * (output - 1) / 2  # decode rows' context lengths, summed
        kv_bytes += contexts * KV_BYTES_PER_TOKEN
    return flops / matmul_flops + kv_bytes / copy_bps


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> int:
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                              cwd=ROOT)
    tail = log.read_text().splitlines()[-3:]
    print("  " + "\n  ".join(tail), flush=True)
    return proc.returncode


def run_pagedserve(workloads: list[str], out: Path, extra: list[str]) -> dict:
    results = {}
    for w in workloads:
        path = out / f"pagedserve_{w}.json"
        run([sys.executable, "benchmarks/bench_serving.py", "--workload", w, "--skip-hf",
             "--out", str(path), "--log-dir", str(out / "logs"), *extra], out / f"pagedserve_{w}.log")
        if path.exists():
            results[w] = json.loads(path.read_text())
    return results


def run_vllm(workloads: list[str], out: Path, vllm_dir: Path) -> dict:
    path = out / "vllm.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own site only
    run([sys.executable, str(vllm_dir / "offline_bench.py"), "--workloads", ",".join(workloads),
         "--out", str(path)], out / "vllm.log", env=env)
    return json.loads(path.read_text()) if path.exists() else {}


def ceilings(out: Path) -> dict:
    path = out / "ceilings.json"
    run([sys.executable, "benchmarks/bench_kernels.py", "--only", "matmul", "--skip-compile",
         "--json", str(path)], out / "ceilings.log")
    r = json.loads(path.read_text())
    return {"matmul_tflops": r["matmul"]["peak_tflops"], "copy_GBps": r["copy_bw_GBps"],
            "matmul_by_tokens": {k: v for k, v in r["matmul"].items() if k != "peak_tflops"}}


def table(workloads, ours: dict, vllm: dict, ceil: dict | None) -> str:
    lines = ["| workload | pagedserve tok/s | vLLM tok/s | ratio | floor tok/s | pagedserve / floor "
             "| vLLM / floor | pagedserve TTFT p50 / ITL p50 | complete (ours, vLLM) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        s = ours.get(w, {}).get("serving", {})
        v = vllm.get("workloads", {}).get(w, {})
        a, b = s.get("output_tok_s"), v.get("output_tok_s")
        expected = sum(o for _, o in make_requests(w, VOCAB))
        floor = (expected / floor_seconds(w, ceil["matmul_tflops"] * 1e12, ceil["copy_GBps"] * 1e9)
                 if ceil else None)
        fmt = (lambda x: f"{x:,.0f}" if x else "n/a")
        frac = (lambda x: f"{x / floor:.0%}" if x and floor else "n/a")
        lines.append(
            f"| {w} | {fmt(a)} | {fmt(b)} | {a / b:.2f}x |" if a and b else f"| {w} | {fmt(a)} | {fmt(b)} | n/a |")
        lines[-1] += (f" {fmt(floor)} | {frac(a)} | {frac(b)} | "
                      + (f"{s['ttft_p50_s']:.2f} s / {s['itl_p50_ms']:.1f} ms" if s else "n/a")
                      + f" | {s.get('complete', 0)}/{s.get('requests', 0)}, "
                      f"{v.get('full_outputs', 0)}/{v.get('requests', 0)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--out-dir", type=Path, default=Path("side_by_side"))
    p.add_argument("--vllm-dir", type=Path, default=Path("/tmp/vllm_parts"),
                   help="where install_on_gpu.sh left offline_bench.py")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-pagedserve", action="store_true")
    p.add_argument("--from-dir", type=Path, default=None,
                   help="print the table from an earlier --out-dir without running anything")
    p.add_argument("pagedserve_args", nargs="*",
                   help="after --: extra bench_serving flags for every workload")
    args = p.parse_args()
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    out = args.from_dir or args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.from_dir:
        ours = {w: json.loads((out / f"pagedserve_{w}.json").read_text()) for w in workloads
                if (out / f"pagedserve_{w}.json").exists()}
        vllm = json.loads((out / "vllm.json").read_text()) if (out / "vllm.json").exists() else {}
        ceil = json.loads((out / "ceilings_summary.json").read_text()) \
            if (out / "ceilings_summary.json").exists() else None
    else:
        ours = {} if args.skip_pagedserve else run_pagedserve(workloads, out, args.pagedserve_args)
        vllm = {} if args.skip_vllm else run_vllm(workloads, out, args.vllm_dir)
        ceil = ceilings(out)
        (out / "ceilings_summary.json").write_text(json.dumps(ceil, indent=1))
    text = table(workloads, ours, vllm, ceil)
    header = (f"side by side, {time.strftime('%Y-%m-%d')}, {vllm.get('gpu', 'GPU n/a')}, "
              f"vLLM {vllm.get('vllm', 'n/a')}; ceilings: "
              + (f"matmul {ceil['matmul_tflops']:.0f} TFLOP/s, copy {ceil['copy_GBps']:.0f} GB/s"
                 if ceil else "n/a") + f"; {time.perf_counter() - start:.0f} s")
    (out / "table.md").write_text(header + "\n\n" + text + "\n")
    print("\n" + header + "\n\n" + text, flush=True)


if __name__ == "__main__":
    main()
