"""The online benchmark's sweeps (bench_online.py's JSON files) as one markdown table and a PNG of
latency against load, one line per server; runs anywhere, reading files brought back from a GPU.

    python3 benchmarks/online_report.py ours.json vllm.json --out-dir online
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

PANELS = (("p50_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
          ("p50_tpot_ms", "TPOT p50 (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"),
          ("p99_itl_ms", "ITL p99 (ms)"), ("output_throughput", "output tokens/s"))


def _num(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _triple(s: dict, name: str) -> str:
    return " / ".join(_num(s.get(f"p{q}_{name}_ms")) for q in (50, 90, 99))


def _load(run: dict) -> str:
    rate, cap = run["request_rate"], run["max_concurrency"]
    merged = run.get("runs_merged", 1)
    return (f"{rate}" + (f", cap {cap}" if cap else "")
            + (f" (median of {merged})" if merged > 1 else ""))


# Counts that add up over a point's repeats; every other number is a median of them.
_SUMMED = ("requests", "completed", "failed", "prompt_tokens", "output_tokens",
           "chunks_not_one_token", "token_count_mismatch")


def medians(result: dict) -> list[dict]:
    """A sweep's runs with each point's repeats (bench_online --repeat) merged into one: its
    counts summed, its rates, times and percentiles the median of the runs', the reasons and
    finish counts added; a point run once is as it was."""
    points: dict[tuple, list[dict]] = {}
    for run in result["runs"]:
        points.setdefault((str(run["request_rate"]), run["max_concurrency"]), []).append(run)
    return [runs[0] if len(runs) == 1 else _merged(runs) for runs in points.values()]


def _merged(runs: list[dict]) -> dict:
    summaries = [r["summary"] for r in runs]
    merged: dict = {}
    for key in summaries[0]:
        values = [s.get(key) for s in summaries]
        if key in _SUMMED:
            merged[key] = sum(values)
        elif isinstance(values[0], dict):
            merged[key] = dict(sum((collections.Counter(v or {}) for v in values),
                                   collections.Counter()))
        else:
            present = [v for v in values if v is not None]
            merged[key] = statistics.median(present) if present else None
    return {"request_rate": runs[0]["request_rate"], "max_concurrency": runs[0]["max_concurrency"],
            "runs_merged": len(runs), "summary": merged}


def format_run(label: str, run: dict) -> str:
    """One run in a line, as the sweep goes."""
    s = run["summary"]
    line = (f"{label} rate {_load(run)}: {s['completed']}/{s['requests']} in {s['wall_s']:.1f} s, "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:,.0f} out tok/s; "
            f"p50/p90/p99 ms TTFT {_triple(s, 'ttft')}, TPOT {_triple(s, 'tpot')}, "
            f"ITL {_triple(s, 'itl')}")
    if s["failed"]:
        line += f"; FAILED {s['failed']}: {s['failure_reasons']}"
    return line


def table(results: list[dict]) -> str:
    """Every point of every sweep (the median of its repeats), by offered load then server."""
    lines = ["| load (req/s) | server | completed | req/s | output tok/s | TTFT p50 / p90 / p99 ms "
             "| TPOT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | e2e p50 / p99 ms | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(result["label"], run) for result in results for run in medians(result)]
    rows.sort(key=lambda row: (row[1]["max_concurrency"] or 0, float(row[1]["request_rate"])))
    for label, run in rows:
        s = run["summary"]
        reasons = "; ".join(f"{why} ({n})" for why, n in s["failure_reasons"].items())
        reasons = reasons.replace("|", "\\|").replace("\n", " ")
        failed = f"{s['failed']}: {reasons}" if s["failed"] else "0"
        lines.append(
            f"| {_load(run)} | {label} | {s['completed']}/{s['requests']} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:,.0f} | "
            f"{_triple(s, 'ttft')} | {_triple(s, 'tpot')} | {_triple(s, 'itl')} | "
            f"{_num(s.get('p50_e2e_ms'), 0)} / {_num(s.get('p99_e2e_ms'), 0)} | {failed} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> str | None:
    """Latency and throughput against achieved request throughput, a line per server; None if
    matplotlib is missing (the reason is printed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot, the table only", flush=True)
        return None
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for name, runs in (line for result in results for line in _lines(result)):
        x = [r["summary"]["request_throughput"] for r in runs]
        for ax, (key, title) in zip(axes.flat, PANELS):
            ax.plot(x, [r["summary"].get(key) for r in runs], marker="o", label=name)
            ax.set_title(title)
            ax.set_xlabel("achieved requests/s")
            ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(_title(results))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _lines(result: dict) -> list[tuple[str, list[dict]]]:
    """A sweep's lines, each (name, runs by achieved throughput): one per concurrency cap when
    it ran several rates, else one over its caps."""
    runs = [r for r in medians(result) if r["summary"]["completed"]]
    several_rates = len({str(r["request_rate"]) for r in runs}) > 1
    groups: dict[str, list[dict]] = {}
    for run in runs:
        cap = run["max_concurrency"] if several_rates else None
        groups.setdefault(result["label"] + (f", cap {cap}" if cap else ""), []).append(run)
    return [(name, sorted(group, key=lambda r: r["summary"]["request_throughput"]))
            for name, group in groups.items()]


def _title(results: list[dict]) -> str:
    first = results[0]
    (p_lo, p_hi), (o_lo, o_hi) = first["lengths"]
    return (f"online benchmark, prompts {p_lo}-{p_hi} / outputs {o_lo}-{o_hi} tokens, "
            f"{first['num_requests']} requests a run ({first['date'][:10]})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="bench_online.py --out files")
    p.add_argument("--out-dir", type=Path, default=Path("online"))
    args = p.parse_args(argv)
    results = [json.loads(path.read_text()) for path in args.results]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = table(results)
    (args.out_dir / "table.md").write_text(text + "\n")
    print(text)
    png = plot(results, args.out_dir / "latency_vs_load.png")
    if png:
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
