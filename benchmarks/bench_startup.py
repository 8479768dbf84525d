"""How long an executor takes from its process start to its ready line, on the CPU backend: a
first start (an empty cache folder: a preset is drawn, the GEMM choices and digests made) and
`--runs` later ones on that folder, per model and per tree. With several `--trees` (checkouts,
each run with its own code) the runs alternate between them, so a busy machine slows each alike.

    python -m benchmarks.bench_startup --models preset:tiny default --runs 5 \
        --trees /path/to/old/checkout .

Prints one line per tree and model: the first start, the median of the later ones, and the range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def time_to_ready(tree: Path, model: str, cache_dir: str, timeout: float = 300) -> float:
    """Seconds from spawning `pagedserve-executor` in `tree` to its ready line."""
    cmd = [sys.executable, "-m", "executor_svc.main", "--backend", "cpu", "--port", "0",
           "--fingerprint-cache-dir", cache_dir]
    if model != "default":
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "executor ready on" in line:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                break
        raise RuntimeError(f"{tree}: {model} never got ready (exit {proc.poll()})")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["preset:tiny", "default"],
                   help="--model values; default: the default model (the SmolLM2 GGUF file)")
    p.add_argument("--runs", type=int, default=5, help="starts after the first, per tree and model")
    p.add_argument("--trees", nargs="+", default=["."], help="checkouts to start from")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    trees = [Path(t).resolve() for t in args.trees]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup.") as tmp:
        caches = {(tree, model): str(Path(tmp) / f"{i}-{j}") for i, tree in enumerate(trees)
                  for j, model in enumerate(args.models)}
        for run in range(args.runs + 1):  # run 0: the first start, on an empty cache folder
            for model in args.models:
                for tree in trees:
                    seconds = time_to_ready(tree, model, caches[tree, model])
                    entry = results.setdefault(str(tree), {}).setdefault(model, {"later": []})
                    if run == 0:
                        entry["first"] = seconds
                    else:
                        entry["later"].append(seconds)
    for tree, models in results.items():
        for model, entry in models.items():
            later = entry["later"]
            entry["median"] = statistics.median(later)
            print(f"{tree} {model}: first {entry['first']:.2f} s, later median "
                  f"{entry['median']:.2f} s ({min(later):.2f}-{max(later):.2f}, {len(later)} runs)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
