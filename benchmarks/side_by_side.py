"""pagedserve and vLLM on the same GPU in one run: W1, W2, W3 (BENCHMARK.md) and W4 (RESULTS.md)
through `bench_serving.py` (both services, the public gRPC API) and through vLLM's offline
`LLM.generate` with its defaults (`offline_bench.py` of ../shared/bench/vllm, installed by its
install_on_gpu.sh, through `vllm_preset.py`; W4 through `vllm_w4.py`, prefix caching on), then the
GPU's ceilings (bf16 matmul rate, copy bandwidth) and the ratio table. `--preset NAME` (default
llama3-8b; also qwen3-8b, glm4-9b) is the shape both sides run, with random bf16 weights.
`--prefix-ttft` adds bench_serving's TTFT of a request whose 2,000-token prefix is cached, against
caching off (pagedserve only). `--quantization awq|fp8` quantizes that shape on both sides (ours
loads the folder quant_folder.py writes once into --quant-dir; vLLM runs dummy weights of the
same layout), `--kv-cache-dtype fp8` puts both KV caches in FP8; workloads.py's decode-heavy is
the offline workload where weight-only quantization pays.

    python3 benchmarks/side_by_side.py --workloads W1,W2,W3,W4 --prefix-ttft --out-dir $OUT

On the GPU machine, after the three staging calls of ../shared/bench/vllm/README.md, in the call
that brings .vllm04: `bash .vllm04/install_on_gpu.sh && python3 benchmarks/side_by_side.py ...`.
The ceilings run first, then each run; after each, `summary.json` and `table.md` in --out-dir
are rewritten with everything so far (every run's own JSON and log go under `runs/`): a call cut
off by its time limit still brings back what finished, in two files. W1-W3 with vLLM's
install take 560-600 s, at the device's 600 s limit per call: run `--skip-vllm` in one call and
`--skip-pagedserve` in the next while the machine is held, then here `--merge
A/summary.json B/summary.json --out-dir D` for the one table.
`--repeat N` runs W1 (`--repeat-workloads`) N times on each side, after the other workloads:
pagedserve through N bench_serving runs (fresh services each), vLLM in its one engine; the table
quotes each side's median run and lists every run.
The same requests on both sides (lengths from random.Random(0), ids from random.Random(1), EOS
ignored, every request its full output). Runs one after the other, pagedserve first; each side
gets the whole GPU. The floor is a bound from the measured ceilings, not a reachable rate.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import (CONVERSATION_WORKLOADS, PREFIX_TTFT, WORKLOADS,  # noqa: E402
                           make_requests)  # (this script's folder)
from conversations import ConversationsSpec, turn_lengths  # noqa: E402

DEFAULT_PRESET = "llama3-8b"  # BENCHMARK.md's model
VLLM_OFFLINE_UTILIZATION = 0.9  # offline_bench.py's and vllm_w4.py's gpu_memory_utilization
W4_PRESETS = ("llama3-8b",)  # vllm_w4.py runs Llama-3-8B's shape only


def model_shape(preset: str):
    """The preset's ModelConfig (executor_svc.model_config): the floor's constants."""
    from executor_svc.model_config import ModelConfig, preset_hf_config

    return ModelConfig.from_hf_config(preset_hf_config(preset))


def floor_seconds(workload: str, matmul_flops: float, copy_bps: float, shape) -> float:
    """A lower bound on a workload's time on `shape` (model_shape): every computed row's matrix
    products at the measured matmul rate, prefill attention (over the cached context too) at
    that rate, and each decode row's K/V read once at the copy bandwidth. Weights re-read per
    step, biases, norms, sampling and everything else count as zero; cached prompt tokens
    (request_sizes) cost nothing."""
    layers, hidden, heads, head_dim = (shape.num_layers, shape.hidden_size, shape.num_heads,
                                       shape.head_dim)
    kv_bytes_per_token = 2 * layers * shape.num_kv_heads * head_dim * 2  # K and V, bf16
    flops = kv_bytes = 0.0
    for c, p, output in request_sizes(workload):
        rows = p + output - 1
        flops += 2 * rows * layers * layer_params(shape) + 2 * output * hidden * shape.vocab_size
        flops += 4 * layers * heads * head_dim * (p * c + p * (p + 1) / 2)  # QK^T, PV, causal
        contexts = output * (c + p) + output * (output - 1) / 2  # decode rows' contexts, summed
        kv_bytes += contexts * kv_bytes_per_token
    return flops / matmul_flops + kv_bytes / copy_bps


def layer_params(shape) -> int:
    """One decoder layer's matrix weights: q, k, v, o and the gated MLP's three."""
    hidden, head_dim = shape.hidden_size, shape.head_dim
    attention = hidden * (shape.num_heads + 2 * shape.num_kv_heads) * head_dim
    return attention + shape.num_heads * head_dim * hidden + 3 * hidden * shape.intermediate_size


def request_sizes(workload: str) -> list[tuple[int, int, int]]:
    """(cached prompt tokens, prompt tokens to compute, output tokens) of each request. W1-W3
    share nothing. W4 as if the cache kept everything: the system prompt is computed once, and a
    turn computes only its new tokens and the previous turn's last output token (sampled, never
    fed back)."""
    if workload not in CONVERSATION_WORKLOADS:  # lengths only: any vocabulary gives the same
        return [(0, len(prompt), output) for prompt, output in make_requests(workload, 2)]
    spec, sizes = ConversationsSpec(), []
    for i, turns in enumerate(turn_lengths(spec, 2)):
        cached = spec.system_tokens if i else 0
        for prompt, output in turns:
            sizes.append((cached, prompt - cached, output))
            cached = prompt + output - 1
    return sizes


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> int:
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                              cwd=ROOT)
    lines = log.read_text().splitlines()
    # vLLM names the kernel each quantized layer type runs ("Using MacheteLinearKernel for
    # AutoAWQMarlinLinearMethod"): the run's record of what ours was measured against
    kernels = list(dict.fromkeys(m.group(0) for line in lines
                                 if (m := re.search(r"Using \w+ for \w+Method", line))))
    print("  " + "\n  ".join(kernels + lines[-3:]), flush=True)
    return proc.returncode


def run_pagedserve(workloads: list[str], out: Path, extra: list[str], results: dict,
                   report, repeats: dict[str, int] | None = None) -> None:
    """bench_serving on each workload into `results` (workload -> its JSON), then the extra
    runs of each repeated one (`repeats`: workload -> runs in all), each on fresh services; a
    repeated workload's entry is its median run with every run's rate in serving.runs_tok_s.
    report() after each."""
    runs: dict[str, list[dict]] = {}
    order = list(workloads) + [w for w in workloads for _ in range((repeats or {}).get(w, 1) - 1)]
    for i, w in enumerate(order):
        k = sum(1 for x in order[:i] if x == w)  # earlier runs of w
        name = f"pagedserve_{w}" + (f"_run{k + 1}" if k else "")
        path = out / f"{name}.json"
        run([sys.executable, "benchmarks/bench_serving.py", "--workload", w, "--skip-hf",
             "--out", str(path), "--log-dir", str(out / "logs" / name) if k else
             str(out / "logs"), *extra], out / f"{name}.log")
        if path.exists():
            runs.setdefault(w, []).append(json.loads(path.read_text()))
            results[w] = median_run(runs[w], lambda r: r.get("serving", {}))
        report()


def median_run(runs: list[dict], serving) -> dict:
    """The run of median output rate (the lower middle one of an even count), with every run's
    rate, in run order, as serving(run)["runs_tok_s"] when there is more than one."""
    rates = [serving(r).get("output_tok_s") or 0.0 for r in runs]
    order = sorted(range(len(runs)), key=lambda i: rates[i])
    chosen = json.loads(json.dumps(runs[order[(len(runs) - 1) // 2]]))  # a copy
    if len(runs) > 1:
        serving(chosen)["runs_tok_s"] = rates
    return chosen


def run_vllm(workloads: list[str], out: Path, vllm_dir: Path, results: dict, report,
             repeats: dict[str, int] | None = None, preset: str = DEFAULT_PRESET,
             vllm_args: list[str] = ()) -> None:
    """vLLM's offline runs on the preset's shape (a repeated workload run again at the end, in
    the same engine), then W4's, into `results` (load_vllm's layout); report() after each.
    vllm_args: vllm_preset.py's own flags (--quantization, --kv-cache-dtype)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own site only
    offline = [w for w in workloads if w in WORKLOADS]
    offline += [w for w in offline for _ in range((repeats or {}).get(w, 1) - 1)]
    if offline:
        run([sys.executable, "benchmarks/vllm_preset.py", "--preset", preset, "--vllm-dir",
             str(vllm_dir), "--workloads", ",".join(offline), "--out", str(out / "vllm.json"),
             *vllm_args], out / "vllm.log", env=env)
        results.update(load_vllm(out, workloads))
        report()
    for w in workloads:
        if w in CONVERSATION_WORKLOADS:
            run([sys.executable, "benchmarks/vllm_w4.py", "--out", str(out / f"vllm_{w}.json")],
                out / f"vllm_{w}.log", env=env)
            results.update(load_vllm(out, workloads))
            report()


_RESULT = re.compile(r"^RESULT (\S+) output_tok_s=(\S+) wall_s=(\S+) requests=(\d+) "
                     r"prompt_tokens=\d+ output_tokens=\d+ full_outputs=(\d+)/\d+", re.MULTILINE)


def vllm_runs(log: Path) -> dict[str, list[dict]]:
    """Every offline run's figures from offline_bench's RESULT lines (its JSON keeps only the
    last run of a workload), workload -> runs in order."""
    runs: dict[str, list[dict]] = {}
    text = log.read_text() if log.exists() else ""
    for w, rate, wall, requests, full in _RESULT.findall(text):
        runs.setdefault(w, []).append({"output_tok_s": float(rate), "wall_s": float(wall),
                                       "requests": int(requests), "full_outputs": int(full)})
    return runs


def load_vllm(out: Path, workloads: list[str]) -> dict:
    """offline_bench's results with vllm_w4's W4 added; a workload run more than once: its
    median run, every run's rate in runs_tok_s (from the log's RESULT lines)."""
    path = out / "vllm.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for w, runs in vllm_runs(out / "vllm.log").items():
        if len(runs) > 1 and w in results.get("workloads", {}):
            results["workloads"][w] = median_run(runs, lambda r: r)
    for w in workloads:
        path = out / f"vllm_{w}.json"
        if w in CONVERSATION_WORKLOADS and path.exists():
            w4 = json.loads(path.read_text())
            for key in ("vllm", "gpu"):
                results.setdefault(key, w4[key])
            results.setdefault("workloads", {})[w] = w4["workloads"][w]
    return results


def run_prefix_ttft(out: Path, extra: list[str]) -> dict | None:
    path = out / f"pagedserve_{PREFIX_TTFT}.json"
    run([sys.executable, "benchmarks/bench_serving.py", "--workload", PREFIX_TTFT, "--out",
         str(path), "--log-dir", str(out / "logs"), *extra], out / f"pagedserve_{PREFIX_TTFT}.log")
    return json.loads(path.read_text()) if path.exists() else None


def ceilings(out: Path) -> dict | None:
    """The GPU's bf16 matmul rate and copy bandwidth (bench_kernels), or None if it failed."""
    path = out / "ceilings.json"
    run([sys.executable, "benchmarks/bench_kernels.py", "--only", "matmul", "--skip-compile",
         "--json", str(path)], out / "ceilings.log")
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    return {"matmul_tflops": r["matmul"]["peak_tflops"], "copy_GBps": r["copy_bw_GBps"],
            "matmul_by_tokens": {k: v for k, v in r["matmul"].items() if k != "peak_tflops"}}


def table(workloads, ours: dict, vllm: dict, ceil: dict | None, shape) -> str:
    lines = ["| workload | pagedserve tok/s | vLLM tok/s | ratio | floor tok/s | pagedserve / floor "
             "| vLLM / floor | pagedserve TTFT p50 / ITL p50 | complete (ours, vLLM) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        s = ours.get(w, {}).get("serving", {})
        v = vllm.get("workloads", {}).get(w, {})
        a, b = s.get("output_tok_s"), v.get("output_tok_s")
        expected = sum(o for _, _, o in request_sizes(w))
        floor = (expected / floor_seconds(w, ceil["matmul_tflops"] * 1e12, ceil["copy_GBps"] * 1e9,
                                          shape) if ceil else None)
        fmt = (lambda x: f"{x:,.0f}" if x else "n/a")
        frac = (lambda x: f"{x / floor:.0%}" if x and floor else "n/a")
        lines.append(
            f"| {w} | {fmt(a)} | {fmt(b)} | {a / b:.2f}x |" if a and b else f"| {w} | {fmt(a)} | {fmt(b)} | n/a |")
        lines[-1] += (f" {fmt(floor)} | {frac(a)} | {frac(b)} | "
                      + (f"{s['ttft_p50_s']:.2f} s / {s['itl_p50_ms']:.1f} ms" if s else "n/a")
                      + f" | {s.get('complete', 0)}/{s.get('requests', 0)}, "
                      f"{v.get('full_outputs', 0)}/{v.get('requests', 0)} |")
    lines += [conversation_line(w, ours, vllm) for w in workloads if w in CONVERSATION_WORKLOADS]
    lines += [line for w in workloads if (line := runs_line(w, ours, vllm))]
    return "\n".join(lines)


def runs_line(w: str, ours: dict, vllm: dict) -> str | None:
    """Every run's rate of a workload run more than once (the table quotes each side's median
    run)."""
    a = ours.get(w, {}).get("serving", {}).get("runs_tok_s")
    b = vllm.get("workloads", {}).get(w, {}).get("runs_tok_s")
    if not a and not b:
        return None
    fmt = (lambda rates: ", ".join(f"{x:,.0f}" for x in rates) if rates else "one run")
    ratio = (f"; ratio of the medians {statistics.median(a) / statistics.median(b):.3f}"
             if a and b else "")
    return f"\n{w}, every run (tok/s, in order): pagedserve {fmt(a)}; vLLM {fmt(b)}{ratio}"


def conversation_line(w: str, ours: dict, vllm: dict) -> str:
    """A conversation workload's TTFT and prefix-cache hit rate, both sides."""
    s = ours.get(w, {}).get("serving", {})
    v = vllm.get("workloads", {}).get(w, {})
    secs = (lambda r, q: f"{r[q]:.2f} s" if r.get(q) is not None else "n/a")
    rate = (lambda r: f"{r['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in r
            else "n/a")
    return (f"\n{w}: TTFT p50 / p99 pagedserve {secs(s, 'ttft_p50_s')} / {secs(s, 'ttft_p99_s')}, "
            f"vLLM {secs(v, 'ttft_p50_s')} / {secs(v, 'ttft_p99_s')}; prefix cache hit rate "
            f"pagedserve {rate(s)}, vLLM {rate(v)}")


def prefix_ttft_line(result: dict | None) -> str:
    if not result:
        return f"{PREFIX_TTFT}: n/a"
    r = result["serving"]
    ms = (lambda side: f"{side['ttft_p50_s'] * 1e3:.1f} ms" if side["ttft_p50_s"] else "n/a")
    return (f"{PREFIX_TTFT} (pagedserve, {r['requests']} single requests of a "
            f"{r['prefix_tokens']}-token prefix + {r['new_tokens']}): TTFT median cached "
            f"{ms(r['cached'])}, caching off {ms(r['uncached'])}, ratio "
            + (f"{r['ratio']:.1f}x" if r["ratio"] else "n/a"))


def summary(workloads: list[str], ours: dict, vllm: dict, ceil: dict | None,
            prefix: dict | None) -> dict:
    """The figures the table is made of, small enough to travel back alone."""
    keys = ("output_tok_s", "complete", "full_outputs", "requests", "wall_s", "ttft_p50_s",
            "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "prefix_cache_hit_rate",
            "preemptions_swap", "preemptions_recompute", "executor_step_timing", "runs_tok_s")
    pick = (lambda r: {k: r[k] for k in keys if k in r})
    return {"ceilings": ceil, "vllm_version": vllm.get("vllm"), "gpu": vllm.get("gpu"),
            "pagedserve": {w: pick(ours[w].get("serving", {})) for w in workloads if w in ours},
            "vllm": {w: pick(r) for w, r in vllm.get("workloads", {}).items()},
            "prefix_ttft": prefix and {k: v for k, v in prefix["serving"].items()
                                       if not isinstance(v, (list, dict)) or k in
                                       ("cached", "uncached")}}


def merge_summaries(paths: list[Path]) -> tuple[dict, dict, dict | None, dict | None]:
    """(ours, vllm, ceilings, prefix) from summary.json files of calls on one lease (e.g. one
    call --skip-vllm, the next --skip-pagedserve); a later file fills only what earlier ones
    lack."""
    ours: dict = {}
    vllm: dict = {"workloads": {}}
    ceil = prefix = None
    for path in paths:
        s = json.loads(path.read_text())
        for w, r in s["pagedserve"].items():
            ours.setdefault(w, {"serving": r})
        for w, r in s["vllm"].items():
            vllm["workloads"].setdefault(w, r)
        for key, value in (("vllm", s["vllm_version"]), ("gpu", s["gpu"])):
            if value and key not in vllm:
                vllm[key] = value
        ceil = ceil or s["ceilings"]
        prefix = prefix or (s["prefix_ttft"] and {"serving": s["prefix_ttft"]})
    return ours, vllm, ceil, prefix


def gather(args, workloads: list[str], out: Path, runs: Path, report
           ) -> tuple[dict, dict, dict | None, dict | None]:
    """Both sides' results, the ceilings and prefix-ttft's: run now (report(ours, vllm, ceil,
    prefix) after each run), or read from --from-dir."""
    prefix_path = runs / f"pagedserve_{PREFIX_TTFT}.json"
    if args.merge:
        return merge_summaries(args.merge)
    if args.from_dir:
        ours = {}
        for w in workloads:  # with its repeated runs (pagedserve_W1_run2.json ...), if any
            paths = [runs / f"pagedserve_{w}.json",
                     *sorted(runs.glob(f"pagedserve_{w}_run*.json"),
                             key=lambda q: int(q.stem.rsplit("run", 1)[1]))]
            found = [json.loads(q.read_text()) for q in paths if q.exists()]
            if found:
                ours[w] = median_run(found, lambda r: r.get("serving", {}))
        ceil = json.loads((runs / "ceilings_summary.json").read_text()) \
            if (runs / "ceilings_summary.json").exists() else None
        prefix = json.loads(prefix_path.read_text()) if prefix_path.exists() else None
        return ours, load_vllm(runs, workloads), ceil, prefix
    ours: dict = {}
    vllm: dict = {}
    prefix = None

    def progress() -> None:  # reads ceil and prefix as they are when called
        report(ours, vllm, ceil, prefix)

    ceil = ceilings(runs)  # first: cheap, and never the run a time limit cuts off
    (runs / "ceilings_summary.json").write_text(json.dumps(ceil, indent=1))
    repeats = {w: args.repeat for w in args.repeat_workloads.split(",") if w in workloads}
    if not args.skip_pagedserve:
        if args.quantization and not args.quant_folder.exists():
            run([sys.executable, "benchmarks/quant_folder.py", "--preset", args.preset,
                 "--method", args.quantization, "--out", str(args.quant_folder)],
                runs / "quant_folder.log")
        run_pagedserve(workloads, runs, args.pagedserve_args, ours, progress, repeats)
        if args.prefix_ttft:
            prefix = run_prefix_ttft(runs, args.pagedserve_args)
            progress()
    if not args.skip_vllm:
        run_vllm(workloads, runs, args.vllm_dir, vllm, progress, repeats, args.preset,
                 args.vllm_args)
    return ours, vllm, ceil, prefix


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--prefix-ttft", action="store_true",
                   help="also bench_serving --workload prefix-ttft (pagedserve, caching on/off)")
    p.add_argument("--out-dir", type=Path, default=Path("side_by_side"))
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help="the model shape of both sides (executor_svc.model_config.PRESETS; vLLM "
                        "runs llama3-8b, qwen3-8b, glm4-9b); --merge and --from-dir take it for "
                        "the floor")
    p.add_argument("--vllm-dir", type=Path, default=Path("/tmp/vllm_parts"),
                   help="where install_on_gpu.sh left offline_bench.py")
    p.add_argument("--quantization", choices=("awq", "fp8"), default=None,
                   help="the preset's shape quantized on both sides: ours loads the folder "
                        "quant_folder.py writes (once) into --quant-dir, vLLM runs dummy weights "
                        "of the same layout")
    p.add_argument("--quant-dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the quantized folder is written (not under --out-dir: "
                        "gigabytes)")
    p.add_argument("--kv-cache-dtype", default=None, help="fp8: both sides' KV cache in FP8")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each of --repeat-workloads this many times on each side (after the "
                        "others); the table quotes the median run and lists them all")
    p.add_argument("--repeat-workloads", default="W1")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-pagedserve", action="store_true")
    p.add_argument("--from-dir", type=Path, default=None,
                   help="print the table from an earlier --out-dir (its runs/, or the folder "
                        "itself) without running anything")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="SUMMARY",
                   help="print the table from summary.json files of calls on one lease (one "
                        "--skip-vllm, one --skip-pagedserve) into --out-dir, running nothing")
    p.add_argument("pagedserve_args", nargs="*",
                   help="after --: extra bench_serving flags for every workload")
    return p


def _parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str], object]:
    """(args, workloads, the preset's shape); bench_serving's flags start with the preset's
    --model."""
    p = _parser()
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    known = [*WORKLOADS, *CONVERSATION_WORKLOADS]
    unknown = [w for w in workloads if w not in known]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {known}")
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    try:
        shape = model_shape(args.preset)
    except ValueError as err:
        p.error(f"--preset: {err}")
    if any(a == "--model" or a.startswith("--model=") for a in args.pagedserve_args):
        p.error("--model among bench_serving's flags: --preset names the model of both sides")
    conversations = [w for w in workloads if w in CONVERSATION_WORKLOADS]
    if conversations and args.preset not in W4_PRESETS and not args.skip_vllm:
        p.error(f"--preset {args.preset}: vLLM's {','.join(conversations)} (vllm_w4.py) runs "
                f"{', '.join(W4_PRESETS)} only; add --skip-vllm")
    if args.quantization and conversations:
        p.error(f"--quantization: {','.join(conversations)} runs unquantized (vllm_w4.py)")
    args.quant_folder = args.quant_dir / f"pagedserve-{args.preset}-{args.quantization}"
    model = str(args.quant_folder) if args.quantization else f"preset:{args.preset}"
    # vLLM's side (offline_bench.py) runs at 0.9 of the GPU's memory, not its server's default:
    # ours at the same share
    args.pagedserve_args = ["--model", model, "--gpu-memory-utilization",
                            str(VLLM_OFFLINE_UTILIZATION), *args.pagedserve_args]
    args.vllm_args = []
    if args.quantization:
        args.vllm_args += ["--quantization", args.quantization]
    if args.kv_cache_dtype:
        args.pagedserve_args += ["--kv-cache-dtype", args.kv_cache_dtype]
        args.vllm_args += ["--kv-cache-dtype", args.kv_cache_dtype]
    return args, workloads, shape


def main(argv: list[str] | None = None) -> None:
    args, workloads, shape = _parse_args(argv)
    out = args.from_dir or args.out_dir
    runs = out / "runs"
    if args.from_dir and not runs.is_dir():  # a folder written before runs/ existed
        runs = out
    runs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def report(ours: dict, vllm: dict, ceil: dict | None, prefix: dict | None) -> None:
        text = table(workloads, ours, vllm, ceil, shape)
        if args.prefix_ttft:
            text += "\n\n" + prefix_ttft_line(prefix)
        quant = " ".join(filter(None, (args.quantization, args.kv_cache_dtype and
                                       f"KV {args.kv_cache_dtype}")))
        header = (f"side by side, {args.preset}{' ' + quant if quant else ''}, "
                  f"{time.strftime('%Y-%m-%d')}, "
                  f"{vllm.get('gpu', 'GPU n/a')}, "
                  f"vLLM {vllm.get('vllm', 'n/a')}; ceilings: "
                  + (f"matmul {ceil['matmul_tflops']:.0f} TFLOP/s, copy "
                     f"{ceil['copy_GBps']:.0f} GB/s" if ceil else "n/a")
                  + f"; {time.perf_counter() - start:.0f} s")
        (out / "table.md").write_text(header + "\n\n" + text + "\n")
        (out / "summary.json").write_text(json.dumps(
            dict(summary(workloads, ours, vllm, ceil, prefix), preset=args.preset), indent=1))
        print("\n" + header + "\n\n" + text + "\n", flush=True)

    report(*gather(args, workloads, out, runs, report))


if __name__ == "__main__":
    main()
