"""Where an FP8 W8A8 model's products stand against vLLM's: Llama-3-8B's four layer products with
e4m3 weights (a scale per output channel) and activations quantized per token, at decode and
prefill row counts. Ours: the product the model runs after a fused norm or silu_and_mul
(pagedserve_kernels.fp8.fp8_scaled_linear, torch's row-wise scaled product) and the one
quantizing pass a product without such a kernel before it adds (ops.quantize_fp8, o_proj's);
beside them cuBLASLt's row-wise product called directly (gemm.CublasLt.fp8_matmul, the scales
as outer vectors) with its heuristic's first algorithm and with the fastest of those it offers
whose output agrees with ours (what tuning the algorithm, as LinearTuner does for bf16, would
give), cuBLASLt's FP8 product with one scale a tensor (torch._scaled_mm, tensor-wise: not the
same arithmetic, the library's own kernel for the same bytes) and bf16 F.linear. With
--vllm-site, vLLM's CUTLASS product (`cutlass_scaled_mm`, what its compressed-tensors FP8
layers run on Hopper) and its per-token quantization (`scaled_fp8_quant`), timed the same way
in a child process that alone has SITE on its path.

    PYTHONPATH=. python3 benchmarks/bench_fp8.py [--rows 1 16 256 ...] [--vllm-site /tmp/vllm_site]
                                                 [--json out.json]

Each product runs over enough distinct weights (>= 256 MB) that none is read from L2, all captured
in one CUDA graph (bench_kernels.graph_ms); the median replay over the weights gives µs/product.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_kernels import MATMUL_SHAPES as SHAPES, graph_ms  # noqa: E402  (this folder)
from bench_quant import copies_for, run_vllm_child  # noqa: E402

ROWS = (1, 16, 64, 128, 256, 512, 1024, 2048, 8192)
FP8 = torch.float8_e4m3fn


def per_product_us(product, weights: list) -> float:
    """µs per product: one graph of product(w) over every weight, median of 7 replays."""
    return graph_ms(lambda: [product(w) for w in weights], calls=1, replays=7) * 1e3 / len(weights)


def fp8_weights(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Distinct (e4m3 [N, K], float32 [N] scale) weights, enough to rotate past L2."""
    out = []
    for _ in range(copies_for(n * k)):
        w = (torch.randn(n, k, device="cuda") * 0.02).to(FP8)
        out.append((w, torch.rand(n, device="cuda") * 1e-3 + 1e-4))
    return out


def quantized_rows(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from pagedserve_kernels import reference

    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    xq, scale = reference.quantize_fp8(x)
    return x, xq, scale


def cublaslt_us(lt, xq: torch.Tensor, scale: torch.Tensor, weights: list, n: int,
                k: int) -> tuple[float | None, float | None]:
    """(µs of cuBLASLt's first heuristic algorithm, µs of its fastest) for the row-wise FP8
    product, over the algorithms whose output agrees with fp8_scaled_linear's within one bf16
    rounding of the largest value; None where none ran or agreed (the first: where it did not)."""
    from pagedserve_kernels import fp8

    rows = xq.shape[0]
    try:
        algos = lt.algos(rows, n, k, torch.bfloat16, fp8=True)
    except RuntimeError as exc:  # this cuBLASLt has no outer-vector FP8 product
        print(f"cuBLASLt FP8 row-wise at {rows} x {n} x {k}: {exc}", flush=True)
        return None, None
    w, w_scale = weights[0]
    ref = fp8.fp8_scaled_linear(xq, scale, w, w_scale, None, torch.bfloat16).float()
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    times = {}
    for i, algo in enumerate(algos):
        try:
            lt.fp8_matmul(algo, xq, scale, w, w_scale, out)
        except RuntimeError:
            continue
        if (out.float() - ref).abs().max() > 2.0 ** -7 * ref.abs().max():
            continue
        times[i] = per_product_us(lambda p, a=algo: lt.fp8_matmul(a, xq, scale, p[0], p[1], out),
                                  weights)
    return times.get(0), min(times.values(), default=None)


def ours(rows_list) -> dict:
    from pagedserve_kernels import fp8, ops
    from pagedserve_kernels.gemm import CublasLt

    lt = CublasLt(torch.device("cuda"))
    out = {}
    for name, n, k in SHAPES:
        weights = fp8_weights(n, k)
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                 for _ in range(copies_for(2 * n * k))]
        for rows in rows_list:
            x, xq, scale = quantized_rows(rows, k)
            one = torch.ones(1, dtype=torch.float32, device="cuda")
            first, fastest = cublaslt_us(lt, xq, scale, weights, n, k)
            out[f"{name} {rows}"] = {
                "lt_first_us": first,
                "lt_best_us": fastest,
                "bf16_us": per_product_us(lambda w: F.linear(x, w), dense),
                "fp8_us": per_product_us(lambda w: fp8.fp8_scaled_linear(
                    xq, scale, w[0], w[1], None, torch.bfloat16), weights),
                "tensorwise_us": per_product_us(lambda w: torch._scaled_mm(
                    xq, w[0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), weights),
                # the pass o_proj's rows take (the others' is fused into the kernel before)
                "quant_us": per_product_us(lambda w: ops.quantize_fp8(x), weights[:2]),
            }
            print(name, rows, {key: v if v is None else round(v, 1)
                               for key, v in out[f"{name} {rows}"].items()}, flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    return out


def vllm_worker(path: str, rows_list) -> None:
    """In the child: vLLM's CUTLASS FP8 product on the same shapes, its weights laid out as its
    FP8 linear layers keep them ([K, N] column-major views, a [N, 1] float32 scale), and its
    per-token quantization."""
    from vllm import _custom_ops as ops

    params = inspect.signature(ops.scaled_fp8_quant).parameters
    per_token = ({"use_per_token_if_dynamic": True}
                 if "use_per_token_if_dynamic" in params else {})
    out = {}
    for name, n, k in SHAPES:
        weights = [(w.t(), s.view(n, 1).contiguous()) for w, s in fp8_weights(n, k)]
        for rows in rows_list:
            x, xq, scale = quantized_rows(rows, k)
            out[f"{name} {rows}"] = {
                "vllm_fp8_us": per_product_us(lambda w: ops.cutlass_scaled_mm(
                    xq, w[0], scale, w[1], torch.bfloat16), weights),
                "vllm_quant_us": per_product_us(
                    lambda w: ops.scaled_fp8_quant(x, **per_token), weights[:2]),
            }
        del weights
        torch.cuda.empty_cache()
    Path(path).write_text(json.dumps(out))


def run_vllm(site: str, rows_list) -> dict:
    return run_vllm_child(__file__, "--vllm-worker", site, ["--rows", *map(str, rows_list)])


def table(results: dict, rows_list) -> None:
    keys = ("bf16_us", "fp8_us", "lt_first_us", "lt_best_us", "tensorwise_us", "quant_us",
            "vllm_fp8_us", "vllm_quant_us")
    print("| product | rows | bf16 µs | ours FP8 µs | FP8 vs bf16 | cuBLASLt row-wise, first "
          "algorithm µs | fastest algorithm µs | cuBLASLt tensor-wise µs | vLLM CUTLASS µs | "
          "ours vs vLLM | our quantizing µs | vLLM's µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, _, _ in list(SHAPES) + [("layer", 0, 0)]:
        for rows in rows_list:
            if name == "layer":  # one decoder layer's four products (and o_proj's quantizing)
                parts = [results[f"{s} {rows}"] for s, _, _ in SHAPES]
                r = {key: sum(p[key] for p in parts) if all(p.get(key) is not None
                                                            for p in parts) else None
                     for key in keys}
                r["quant_us"] = results[f"o {rows}"]["quant_us"]
                r["vllm_quant_us"] = results[f"o {rows}"].get("vllm_quant_us")
            else:
                r = {key: results[f"{name} {rows}"].get(key) for key in keys}

            def cell(key):
                return "n/a" if r.get(key) is None else f"{r[key]:.1f}"

            # above 1: ours takes less time
            ratio = ("n/a" if r.get("vllm_fp8_us") is None
                     else f"{r['vllm_fp8_us'] / r['fp8_us']:.2f}x")
            print(f"| {name} | {rows} | {cell('bf16_us')} | {cell('fp8_us')} | "
                  f"{r['bf16_us'] / r['fp8_us']:.2f}x | {cell('lt_first_us')} | "
                  f"{cell('lt_best_us')} | {cell('tensorwise_us')} | "
                  f"{cell('vllm_fp8_us')} | {ratio} | {cell('quant_us')} | "
                  f"{cell('vllm_quant_us')} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--vllm-site", help="a folder holding vLLM (compare with its CUTLASS product)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--vllm-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.manual_seed(0)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, args.rows)
        return
    results = ours(args.rows)
    if args.vllm_site:
        for key, value in run_vllm(args.vllm_site, args.rows).items():
            results[key].update(value)
    table(results, args.rows)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
