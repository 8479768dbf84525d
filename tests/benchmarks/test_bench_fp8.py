"""bench_fp8's report: each product's row and one decoder layer's (its four products summed,
o_proj's quantizing pass once), the ratios the right way round, vLLM's columns n/a without it."""
from __future__ import annotations

import bench_fp8


def _results(with_vllm: bool) -> dict:
    out = {}
    for i, (name, _, _) in enumerate(bench_fp8.SHAPES):
        r = {"bf16_us": 20.0 + i, "fp8_us": 10.0 + i, "lt_first_us": 10.0 + i,
             "lt_best_us": 8.0 if i == 2 else None, "tensorwise_us": 9.0, "quant_us": 2.0 + i}
        if with_vllm:
            r.update(vllm_fp8_us=12.0 + i, vllm_quant_us=3.0)
        out[f"{name} 16"] = r
    return out


def test_the_layer_row_sums_the_products_and_takes_o_projs_quantizing(capsys):
    bench_fp8.table(_results(True), [16])
    rows = {line.split(" | ")[0]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and " | 16 | " in line}
    o = [name for name, _, _ in bench_fp8.SHAPES].index("o")
    # four products: bf16 20+21+22+23, FP8 10+11+12+13, vLLM 12+13+14+15
    # the fastest algorithm's column sums only where every product has one
    assert rows["| layer"] == (f"| layer | 16 | 86.0 | 46.0 | {86 / 46:.2f}x | 46.0 | n/a | "
                               f"36.0 | 54.0 | {54 / 46:.2f}x | {2.0 + o:.1f} | 3.0 |")
    assert rows["| qkv"].startswith("| qkv | 16 | 20.0 | 10.0 | 2.00x | 10.0 | n/a | 9.0 | "
                                    "12.0 | 1.20x |")


def test_without_vllm_its_columns_are_not_filled(capsys):
    bench_fp8.table(_results(False), [16])
    layer = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("| layer")][0]
    o = [name for name, _, _ in bench_fp8.SHAPES].index("o")
    assert layer == (f"| layer | 16 | 86.0 | 46.0 | {86 / 46:.2f}x | 46.0 | n/a | 36.0 | n/a | "
                     f"n/a | {2.0 + o:.1f} | n/a |")
