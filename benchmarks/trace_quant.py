"""Where the time of the W4A16 tiles goes (diagnostics): the producer-fed wgt and wgs kernels (a
GPU whose quant module builds for sm_90a) and the mma.sync tiles (m16, m32, m64, m128), built
with PS_QUANT_TRACE (module "quant_trace"), record, for each CTA and run of K stages, when the
run started, when its MMAs retired and when its output was out, and the mma.sync tiles the
cycles their stage barriers took (waiting for the copies and for the other warps). Printed for
each product, row count and tile: the span, each run's main loop per K stage (median, p10, p90;
whole tiles and shared ones apart) and the barriers' share of it, the epilogues by how the
output left (stored; a part written; summed by the head or by the last to arrive), and the
gaps between a CTA's runs. The trace build adds a few registers to the tiles, so its times are
the tiles' give or take a little; bench_quant times them untraced.

    PYTHONPATH=. python3 benchmarks/trace_quant.py [--shapes gate_up qkv] [--rows 128 256 512]
                                                   [--tiles wgt128 wgs128 wgt256 wgs256]
    PYTHONPATH=. python3 benchmarks/trace_quant.py --shapes qkv o gate_up down --rows 1 16 \
        --tiles m16 [--splits 4]
    PYTHONPATH=. python3 benchmarks/trace_quant.py --shapes gate_up --rows 256 512 --tiles wgt256 \
        --last-wave stream

With --last-wave FORM a wgt tile whose tiles fill no whole number of waves is traced as the
launcher splits it (quant.wave_split): the whole waves' launch and the rest's (the wgt tile with
K in parts, or the stream-K wgs tile) traced one at a time, each summarised on its own.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_kernels import MATMUL_SHAPES as SHAPES  # noqa: E402  (this folder)
from bench_quant import int4_weights  # noqa: E402

TRACE_MODULE, TRACE_RUNS, TRACE_FIELDS = "quant_trace", 8, 7  # quant.cu's PS_QUANT_TRACE
HOW = {1: "stored", 2: "part written", 3: "head summed", 4: "last summed"}


def traced_launches():
    """quant's launches of the traced kernels go to the trace build."""
    from pagedserve_kernels import _compile

    traced = set(_compile.ON_DEMAND[TRACE_MODULE][2])
    launch = _compile.launch

    def redirect(module, kernel, *args, **kwargs):
        return launch(TRACE_MODULE if module == "quant" and kernel in traced else module,
                      kernel, *args, **kwargs)

    _compile.launch = redirect


def trace_buffer(device: torch.device):
    import cupy

    from pagedserve_kernels import _compile

    ptr = _compile.get_module(TRACE_MODULE, device).get_global("ps_quant_trace")
    with cupy.cuda.Device(device.index):
        return cupy.ndarray((4096 * TRACE_RUNS * TRACE_FIELDS,), dtype=cupy.uint64, memptr=ptr)


def runs_of(raw: np.ndarray) -> list[dict]:
    runs = []
    for cta, per_cta in enumerate(raw.reshape(4096, TRACE_RUNS, TRACE_FIELDS)):
        for run, (info, start, mma, end, start_ns, end_ns, waited) in enumerate(per_cta.tolist()):
            if end == 0:
                continue
            runs.append({"cta": cta, "run": run, "sm": info & 0xFFFF,
                         "stages": (info >> 16) & 0xFFFF, "how": HOW.get(info >> 48, "?"),
                         "loop_cycles": mma - start, "out_cycles": end - mma,
                         "wait_cycles": waited,
                         "start_ns": start_ns, "end_ns": end_ns,
                         "ghz": (end - start) / max(1, end_ns - start_ns)})
    return runs


def summary(runs: list[dict]) -> dict:
    ghz = float(np.median([r["ghz"] for r in runs if r["end_ns"] > r["start_ns"]] or [1.0]))
    us = 1e-3 / ghz  # µs a cycle

    def stats(values) -> dict:
        if not values:
            return {}
        v = np.array(values)
        return {"n": len(v), "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
                "p90": float(np.percentile(v, 90)), "max": float(v.max())}

    per_stage = {kind: stats([r["loop_cycles"] * us / r["stages"] for r in runs
                              if r["stages"] and (r["how"] == "stored") == (kind == "whole")])
                 for kind in ("whole", "shared")}
    # the mma.sync tiles' barriers, as a share of their main loop (the others record none)
    waiting = stats([r["wait_cycles"] / r["loop_cycles"] for r in runs
                     if r["wait_cycles"] and r["loop_cycles"]])
    out = {how: stats([r["out_cycles"] * us for r in runs if r["how"] == how])
           for how in HOW.values()}
    by_cta: dict[int, list[dict]] = {}
    for r in runs:
        by_cta.setdefault(r["cta"], []).append(r)
    gaps = []
    for rs in by_cta.values():
        rs.sort(key=lambda r: r["run"])
        gaps += [(b["start_ns"] - a["end_ns"]) * 1e-3 for a, b in zip(rs, rs[1:])]
    first = min(r["start_ns"] for r in runs)
    return {"ctas": len(by_cta), "runs": len(runs), "ghz": ghz,
            "span_us": (max(r["end_ns"] for r in runs) - first) * 1e-3,
            "starts_us": stats([(min(r["start_ns"] for r in rs) - first) * 1e-3
                                for rs in by_cta.values()]),
            "ends_us": stats([(max(r["end_ns"] for r in rs) - first) * 1e-3
                              for rs in by_cta.values()]),
            "loop_us_per_stage": per_stage, "barrier_share_of_loop": waiting,
            "epilogue_us": out, "gaps_us": stats(gaps)}


def show(name: str, s: dict) -> None:
    def fmt(st: dict) -> str:
        return (f"median {st['median']:.2f} p10 {st['p10']:.2f} p90 {st['p90']:.2f} "
                f"max {st['max']:.2f} (n {st['n']})") if st else "-"

    print(f"{name}: {s['ctas']} CTAs, {s['runs']} runs, span {s['span_us']:.1f} µs, "
          f"SM clock {s['ghz']:.3f} GHz", flush=True)
    for kind, st in s["loop_us_per_stage"].items():
        print(f"  main loop µs a stage, {kind} tiles: {fmt(st)}")
    if s["barrier_share_of_loop"]:
        print(f"  stage barriers' share of the main loop: {fmt(s['barrier_share_of_loop'])}")
    for how, st in s["epilogue_us"].items():
        if st:
            print(f"  epilogue µs, {how}: {fmt(st)}")
    print(f"  CTA starts µs: {fmt(s['starts_us'])}; ends: {fmt(s['ends_us'])}; "
          f"gaps between a CTA's runs: {fmt(s['gaps_us'])}", flush=True)


def tile_of(name: str) -> tuple[int, str]:
    """"wgt128" -> (128, "wgt"), "m16" -> (16, ""): quant's row tiles by name."""
    family = name.rstrip("0123456789")
    return int(name[len(family):]), "" if family == "m" else family


def launches(quant, x, weight, out, tile, splits, last_wave):
    """[(name suffix, label, launch)]: the product in `tile` as one launch, or with `last_wave`
    where quant.wave_split splits it, its whole waves' launch and the rest's apart."""
    rows = x.shape[0]
    kernel, mt, m_tiles, parts, stages = quant.launch_shape(rows, weight, x.device, x.dtype,
                                                            tile, splits)
    split = (quant.wave_split(kernel, x.device, rows, m_tiles, weight, last_wave)
             if last_wave and parts == 1 else None)
    if split is None:
        return [("", f"{kernel}, K in {parts} parts",
                 lambda: quant._kernel_product(x, weight, None, out, tile, splits, False))]
    head, rest, rest_parts, rest_stages = split
    blocks = weight.qweight.shape[0] * quant.CHUNK // quant.CTA_N - head
    return [(" head", f"{kernel}, the {head} column blocks of the whole waves",
             lambda: quant._launch_product(x, weight, None, out, kernel, mt, m_tiles, 1, stages,
                                           0, head)),
            (f" +{last_wave}", f"{rest}, the other {blocks} blocks, "
             + (f"K in {rest_parts} parts" if last_wave == "parts" else "K shared out"),
             lambda: quant._launch_product(x, weight, None, out, rest, mt, m_tiles, rest_parts,
                                           rest_stages, head, blocks))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["gate_up", "qkv"])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--tiles", nargs="+", default=["wgt128", "wgs128", "wgt256", "wgs256"],
                   help="wgt64-256, wgs64-256, or the mma.sync m16-m128")
    p.add_argument("--splits", type=int, help="K parts (default: the launcher's choice)")
    p.add_argument("--last-wave", choices=("parts", "stream"),
                   help="trace a wgt tile's split launches apart: its whole waves, then the rest")
    p.add_argument("--json", type=Path, help="write the summaries here")
    args = p.parse_args()
    import cupy

    from pagedserve_kernels import _compile, quant

    device = torch.device("cuda", torch.cuda.current_device())
    quant.prepare(device)
    tiles = {name: tile_of(name) for name in args.tiles}
    if (any(family for _, family in tiles.values())
            and _compile.arch_used(device, "quant") != "-arch=sm_90a"):
        sys.exit("the wgt and wgs tiles need the quant module built for sm_90a")
    traced_launches()
    buffer = trace_buffer(device)
    results = {}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # past L2
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        weight = int4_weights(n, k, 128, True, 1)[0]
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
            out = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
            for tile_name, tile in tiles.items():
                for part, label, launch in launches(quant, x, weight, out, tile, args.splits,
                                                    args.last_wave):
                    launch()  # compiled, workspace made
                    torch.cuda.synchronize()
                    buffer.fill(0)
                    flush.zero_()  # the weight comes from memory, as a layer's does in a step
                    cupy.cuda.runtime.deviceSynchronize()
                    launch()
                    torch.cuda.synchronize()
                    s = summary(runs_of(buffer.get()))
                    results[f"{name} {rows} {tile_name}{part}"] = s
                    show(f"{name} {rows} rows {tile_name}{part} ({label})", s)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
