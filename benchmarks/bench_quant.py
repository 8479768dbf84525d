"""Our W4A16 product (pagedserve_kernels.quant.int4_linear) against torch's bf16 F.linear on
Llama-3-8B's four layer products at decode row counts and a prefill step (the kernel in the tile
the device takes untuned), with each other row tile tuning may pick beside it (128 rows a CTA;
on Hopper the wgmma kernels at 64 and 128, and up to 32 rows the candidates summing K parts
through a cluster, column "cl"), the untuned tile at each --splits count of K parts,
and dequantize + F.linear (the cuBLAS route); with --vllm-site, vLLM's Marlin (gptq_marlin,
4-bit, same group size) and, on Hopper, its Machete (the kernel vLLM 0.26 takes there for AWQ
and GPTQ: it lists Machete before Marlin) on the same shapes, timed the same way in a child
process that alone has SITE on its path.

    PYTHONPATH=. python3 benchmarks/bench_quant.py [--rows 1 16 256 ...] [--group 128] [--asym]
                                                   [--splits 1 4 8 ...]
                                                   [--vllm-site /tmp/vllm_site] [--json out.json]

Each product runs over enough distinct weights (>= 256 MB) that none is read from L2, all captured
in one CUDA graph (bench_kernels.graph_ms); the median replay over the weights gives µs/product.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_kernels import MATMUL_SHAPES as SHAPES, graph_ms  # noqa: E402  (this folder)

# From quant.DEQUANT_ROWS the executor dequantizes and runs cuBLAS: the rows around it place it.
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 4096)
ROTATE_BYTES = 256 << 20


def copies_for(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def time_products(product, weights: list, rows: int, k: int) -> float:
    """µs per product: one graph of `product(x, w)` over every weight."""
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    ms = graph_ms(lambda: [product(x, w) for w in weights], calls=1, replays=7)
    return ms * 1e3 / len(weights)


def kernel_us(packed: list, rows: int, k: int, tile=None, count=None, last_wave=None) -> float:
    """µs per product of quant's kernel in row tile `tile` with K in `count` parts (None: the
    launcher's choice of each), its last partial wave split off where `last_wave` says so."""
    from pagedserve_kernels import quant

    return time_products(lambda x, p: quant._kernel_product(
        x, p, None, torch.empty(x.shape[0], p.n, dtype=x.dtype, device=x.device), tile, count,
        last_wave), packed, rows, k)


def last_wave_us(packed: list, rows: int, k: int, tile, form: str) -> float | None:
    """kernel_us with the last partial wave split off in `form` (quant.WAVE_FORMS), where the
    tile has one (else None)."""
    from pagedserve_kernels import quant

    if not quant.has_wave_split(rows, packed[0], torch.device("cuda"), torch.bfloat16, tile,
                                form):
        return None
    return kernel_us(packed, rows, k, tile, None, form)


def int4_weights(n: int, k: int, group: int, asym: bool, count: int) -> list:
    from pagedserve_kernels import quant

    group = k if group == -1 else group
    words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), dtype=torch.int64,
                          device="cuda").to(torch.int32)  # 8 random nibbles each
    scales = (torch.rand(k // group, n, device="cuda") * 0.02 + 1e-3).to(torch.bfloat16)
    zeros = (torch.randint(0, 16, (k // group, n), device="cuda").to(torch.uint8)
             if asym else None)
    return [quant.repack(words, scales, zeros, group) for _ in range(count)]


def ours(rows_list, group: int, asym: bool, splits=()) -> dict:
    from pagedserve_kernels import quant

    from pagedserve_kernels import _compile

    quant.prepare(torch.device("cuda"))
    hopper = _compile.arch_used(torch.device("cuda"), "quant") == "-arch=sm_90a"
    others = [tile for tile in quant.TUNED_TILES + quant.CANDIDATE_TILES
              if tile != quant.NARROW_TILE and (hopper or not tile[1])]
    out = {}
    for name, n, k in SHAPES:
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                 for _ in range(copies_for(2 * n * k))]
        packed = int4_weights(n, k, group, asym, copies_for(n * k // 2))
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        for rows in rows_list:
            # the 16- and 32-row tiles in each K part count tuning times (SMALL_TILES)
            parts = {count: kernel_us(packed, rows, k, count=count)
                     for count in quant.SPLIT_CANDIDATES} if rows <= 32 else {}
            out[f"{name} {rows}"] = {
                "bf16_us": time_products(F.linear, dense, rows, k),
                "int4_us": time_products(quant.int4_linear, packed, rows, k),
                # the same launched plainly: what programmatic launches (prepare()'s default
                # where the device takes them) save between consecutive products
                "plain_int4_us": plain_launches(
                    lambda: time_products(quant.int4_linear, packed, rows, k)),
                # the tiles tuning may take instead (never below 33 rows, where 16 or 32 hold
                # a step)
                **{f"int4_{_tile_name(tile)}_us":
                   kernel_us(packed, rows, k, tile) if rows > 32 else None for tile in others},
                # the same with the last partial wave split off (_kernel_product's last_wave)
                **{f"int4_{_tile_name(tile)}+{form}_us":
                   last_wave_us(packed, rows, k, tile, form) if rows > 32 else None
                   for tile in others if tile[1] in quant._WAVE_SPLIT
                   for form in quant.WAVE_FORMS},
                "dequant_cublas_us": time_products(
                    lambda x, p: F.linear(x, quant.dequantize(p, scratch)), packed, rows, k),
                # the untuned tile with K in each of --splits parts, beside the model's count
                "splits": quant.launch_shape(rows, packed[0], torch.device("cuda"),
                                             torch.bfloat16)[3],
                "int4_parts_us": min(parts.values()) if parts else None,
                "parts": min(parts, key=parts.get) if parts else None,
                # the candidates summing K parts through a cluster, at their fastest count
                "int4_cl_us": min(kernel_us(packed, rows, k, (16 if rows <= 16 else 32, "cl"),
                                            count) for count in (2, 4, 8))
                if rows <= 32 and hopper else None,
                **{f"int4_s{count}_us": kernel_us(packed, rows, k, count=count)
                   for count in splits},
            }
            print(name, rows, {key: v if v is None else round(v, 1)
                               for key, v in out[f"{name} {rows}"].items()},
                  flush=True)
        del dense, packed, scratch
        torch.cuda.empty_cache()
    return out


def plain_launches(measure):
    """measure() with the products launched plainly, then the setting restored."""
    from pagedserve_kernels import quant

    device = torch.device("cuda")
    before = quant.launches_programmatically(device)
    quant.set_programmatic(device, False)
    try:
        return measure()
    finally:
        quant.set_programmatic(device, before)


def _tile_name(tile) -> str:
    return f"{tile[1] or 'm'}{tile[0]}"


def marlin_worker(path: str, rows_list, group: int, asym: bool) -> None:
    """In the child: vLLM's Marlin, and Machete where it runs, on random 4-bit weights (values
    do not change their time)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test as mt
    from vllm.scalar_type import scalar_types

    gemm = getattr(ops, "marlin_gemm", None)  # renamed from gptq_marlin_gemm in later versions
    if gemm is None or "b_q_type" not in inspect.signature(gemm).parameters:
        gemm = ops.gptq_marlin_gemm
    params = inspect.signature(gemm).parameters
    qtype = scalar_types.uint4 if asym else scalar_types.uint4b8
    out = {}
    for name, n, k in SHAPES:
        w = torch.randn(k, n, dtype=torch.bfloat16, device="cuda") * 0.02
        if asym:
            _, q, s, zp = mt.awq_marlin_quantize(w, qtype, group)
        else:
            quantize_args = inspect.signature(mt.marlin_quantize).parameters
            extra = {"act_order": False} if "act_order" in quantize_args else {}
            _, q, s = mt.marlin_quantize(w, qtype, group, **extra)[:3]
            zp = torch.empty(0, dtype=torch.int, device="cuda")
        del w
        empty = torch.empty(0, dtype=torch.int, device="cuda")
        workspace = mt.MarlinWorkspace(n, 64, 16).scratch
        weights = [(q, s, zp)] + [(q.clone(), s.clone(), zp.clone())
                                  for _ in range(copies_for(n * k // 2) - 1)]

        def product(x, weight):
            args = {"a": x, "c": None, "b_q_weight": weight[0], "b_bias": None,
                    "b_scales": weight[1], "a_scales": None, "global_scale": None,
                    "b_zeros": weight[2], "g_idx": empty, "perm": empty, "workspace": workspace,
                    "b_q_type": qtype, "size_m": x.shape[0], "size_n": n, "size_k": k,
                    "is_k_full": True, "use_atomic_add": False, "use_fp32_reduce": True,
                    "is_zp_float": False, "has_zp": asym, "num_bits": 4}
            return gemm(**{key: v for key, v in args.items() if key in params})

        for rows in rows_list:
            out[f"{name} {rows}"] = {"marlin_us": time_products(product, weights, rows, k)}
        del weights
        torch.cuda.empty_cache()
        machete = machete_times(ops, scalar_types, rows_list, n, k, group, asym)
        for rows in rows_list:
            out[f"{name} {rows}"]["machete_us"] = machete.get(rows)
    Path(path).write_text(json.dumps(out))


def machete_times(ops, scalar_types, rows_list, n: int, k: int, group: int,
                  asym: bool) -> dict:
    """{rows: µs} of vLLM's Machete (the CUTLASS mixed-input GEMM vLLM puts before Marlin on
    Hopper for AWQ and GPTQ), weights prepacked as its MacheteLinearKernel does (zero points
    pre-multiplied by -scale); {} where it does not run (not Hopper, or this vLLM lacks it)."""
    prepack, mm = getattr(ops, "machete_prepack_B", None), getattr(ops, "machete_mm", None)
    if prepack is None or mm is None or torch.cuda.get_device_capability() != (9, 0):
        return {}
    qtype = scalar_types.uint4 if asym else scalar_types.uint4b8
    group = k if group == -1 else group
    try:
        weights = []
        for _ in range(copies_for(n * k // 2)):
            words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), dtype=torch.int64,
                                  device="cuda").to(torch.int32)
            q = prepack(words.t().contiguous().t(), a_type=torch.bfloat16, b_type=qtype,
                        group_scales_type=torch.bfloat16)
            s = (torch.rand(k // group, n, device="cuda") * 0.02 + 1e-3).to(torch.bfloat16)
            zp = (-s * torch.randint(0, 16, s.shape, device="cuda").to(s.dtype)
                  if asym else None)
            weights.append((q, s, zp))

        def product(x, weight):
            return mm(a=x, b_q=weight[0], b_type=qtype, b_group_zeros=weight[2],
                      b_group_scales=weight[1], b_group_size=group)

        return {rows: time_products(product, weights, rows, k) for rows in rows_list}
    except Exception as err:  # noqa: BLE001 - a missing kernel leaves the column empty
        print(f"machete: {type(err).__name__}: {err}", flush=True)
        return {}


def run_vllm_child(script: str, worker_flag: str, site: str, args: list[str]) -> dict:
    """Runs `script` with `worker_flag` PATH and `args` in a child process that alone has vLLM's
    SITE on its path; returns the JSON the child wrote to PATH."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vllm.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, str(ROOT)]),
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, script, worker_flag, str(path), *args], env=env,
                       check=True)
        return json.loads(path.read_text())


def run_marlin(site: str, rows_list, group: int, asym: bool) -> dict:
    return run_vllm_child(__file__, "--marlin-worker", site,
                          ["--group", str(group), "--rows", *map(str, rows_list)]
                          + (["--asym"] if asym else []))


def table(results: dict, rows_list) -> None:
    from pagedserve_kernels import quant

    candidates = {_tile_name(tile) for tile in quant.CANDIDATE_TILES}
    tiles = sorted({key[5:-3] for r in results.values() for key in r
                    if key.startswith("int4_") and key != "int4_us"})

    def fastest(r: dict) -> float:  # the fastest route tuning may take for one product
        return min(v for key, v in r.items()
                   if key.startswith(("int4_", "dequant_")) and v is not None
                   and not re.fullmatch(r"int4_s\d+_us", key)  # not a forced split
                   and key[5:-3] not in candidates | {"cl"})  # nor a candidate tile

    print("| product | rows | K splits (model, fastest tuned) | bf16 µs | int4 µs | "
          "int4 vs bf16 | int4, plain launches µs | " + "".join(f"int4, {t} µs | " for t in tiles)
          + "dequant+cuBLAS µs | ours, fastest µs | fastest vs bf16 | Marlin µs | "
          "ours (fastest) vs Marlin | Machete µs | ours (fastest) vs Machete |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(tiles) + "---|---|---|---|---|---|---|")
    for name, _, _ in list(SHAPES) + [("layer", 0, 0)]:
        for rows in rows_list:
            if name == "layer":  # the four products of one decoder layer
                parts = [results[f"{s} {rows}"] for s, _, _ in SHAPES]
                r = {key: sum(p[key] for p in parts) for key in parts[0]
                     if key not in ("splits", "parts")
                     and all(p.get(key) is not None for p in parts)}
                # tuning takes each shape's own fastest route, so the layer's is their sum
                best = sum(fastest(p) for p in parts)
            else:
                r = results[f"{name} {rows}"]
                best = fastest(r)
            against = " | ".join(  # absent without --vllm-site (Machete: off Hopper too)
                "n/a | n/a" if r.get(key) is None else f"{r[key]:.1f} | {r[key] / best:.2f}x"
                for key in ("marlin_us", "machete_us"))
            cells = ["-" if r.get(f"int4_{t}_us") is None else f"{r[f'int4_{t}_us']:.1f}"
                     for t in tiles]
            split = r.get("splits", "-")
            if r.get("parts"):  # and the count of the fastest tuning candidate
                split = f"{split}, {r['parts']}"
            print(f"| {name} | {rows} | {split} | {r['bf16_us']:.1f} | "
                  f"{r['int4_us']:.1f} | "
                  f"{r['bf16_us'] / r['int4_us']:.2f}x | "
                  + ("-" if r.get("plain_int4_us") is None else f"{r['plain_int4_us']:.1f}")
                  + " | " + "".join(c + " | " for c in cells)
                  + f"{r['dequant_cublas_us']:.1f} | {best:.1f} | {r['bf16_us'] / best:.2f}x | "
                  f"{against} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--group", type=int, default=128, help="input rows per scale; -1: per column")
    p.add_argument("--asym", action="store_true", help="zero points per group (AWQ-like)")
    p.add_argument("--vllm-site", help="a folder holding vLLM (compare with its Marlin kernel)")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time the untuned tile with K in each of these many parts (a "
                        "column each; the 'K splits' column is split_k_choice's count)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--marlin-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.manual_seed(0)
    if args.marlin_worker:
        marlin_worker(args.marlin_worker, args.rows, args.group, args.asym)
        return
    results = ours(args.rows, args.group, args.asym, args.splits)
    if args.vllm_site:
        for key, value in run_marlin(args.vllm_site, args.rows, args.group, args.asym).items():
            results[key].update(value)
    table(results, args.rows)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
