"""quant_folder.py: the preset's weights quantized into AutoAWQ's and llm-compressor's FP8
layouts, which our loader reads back as those weights (within a quantization step), and which
bench_serving serves (the CPU backend, a folder's own vocabulary)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import quant_folder
from executor_svc.model_loader import build_hf_model, load_model
from pagedserve_kernels.reference import dequantize_int4

ROOT = Path(__file__).resolve().parents[2]
GROUP = 32  # the tiny preset's hidden size is 64


@pytest.fixture(scope="module")
def tiny_bf16():
    """The tiny preset's weights as quant_folder draws them: {name: float32 tensor}."""
    hf = build_hf_model("tiny", seed=0, dtype=torch.bfloat16)
    return {name: t.float() for name, t in hf.state_dict().items()}


def fused(weights: dict, layer: int) -> torch.Tensor:
    """Layer `layer`'s q, k, v weights stacked as our model fuses them: [N, K]."""
    prefix = f"model.layers.{layer}.self_attn."
    return torch.cat([weights[prefix + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])


def test_an_awq_folder_reads_back_as_the_presets_weights_within_a_step(tmp_path, tiny_bf16):
    folder = quant_folder.write("tiny", "awq", tmp_path / "awq", group=GROUP)
    model, config, tokenizer, _ = load_model(str(folder), "float32")
    assert config.quantization.startswith("awq int4 g32") and tokenizer == ""
    for i, layer in enumerate(model.layers):
        w, q = fused(tiny_bf16, i), layer.qkv_proj
        assert q.perm is None and q.group_size == GROUP
        step = q.scales.float().repeat_interleave(GROUP, dim=0).t()  # [N, K]
        error = (dequantize_int4(q.qweight, q.scales, q.zeros, GROUP) - w).abs()
        assert (error <= step * 1.001).all()  # a nibble out of place is several steps off
        assert error.mean() < 0.3 * step.mean()


def test_an_fp8_folder_reads_back_within_e4m3s_precision(tmp_path, tiny_bf16):
    folder = quant_folder.write("tiny", "fp8", tmp_path / "fp8")
    model, config, _, _ = load_model(str(folder), "float32")
    assert "fp8" in config.quantization
    for i, layer in enumerate(model.layers):
        w, q = fused(tiny_bf16, i), layer.qkv_proj
        assert q.per_token and q.input_scale is None and q.weight_scale.shape == (w.shape[0],)
        got = q.weight.float() * q.weight_scale[:, None]
        assert ((got - w).abs() <= w.abs() / 16 + q.weight_scale[:, None] / 2**9).all()


def test_bench_serving_serves_a_folder_on_its_own_vocabulary(tmp_path):
    """decode-heavy's first two requests through both services on the CPU backend."""
    folder = quant_folder.write("tiny", "awq", tmp_path / "awq", group=GROUP)
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--workload", "decode-heavy",
                    "--model", str(folder), "--backend", "cpu", "--num-requests", "2",
                    "--skip-hf", "--out", str(out)], cwd=ROOT, check=True, timeout=300,
                   capture_output=True)
    serving = json.loads(out.read_text())["serving"]
    assert serving["complete"] == serving["requests"] == 2
    assert serving["output_tokens"] == serving["expected_output_tokens"] >= 2 * 512


def test_an_existing_out_folder_is_one_usage_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        quant_folder.main(["--preset", "tiny", "--method", "awq", "--out", str(tmp_path)])
    assert "exists" in capsys.readouterr().err
