"""A quantized checkpoint of a preset's shape, for quantized serving side by side with vLLM: the
preset's random bf16 weights (executor_svc.model_loader.build_hf_model) quantized as the tools
write them, AutoAWQ's GEMM layout (4-bit, zero points, groups of 128) or compressed-tensors FP8
as llm-compressor's FP8_DYNAMIC recipe does (per-channel e4m3 weights, dynamic per-token
activations). pagedserve loads the folder; vLLM runs the same config.json on dummy weights
(vllm_preset.py --quantization), which is what a throughput comparison needs.

    python3 benchmarks/quant_folder.py --preset llama3-8b --method awq --out /tmp/llama3-8b-awq

No tokenizer is written (token-id prompts). Llama and Qwen3 presets (their linears are q/k/v/o
and gate/up/down).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_GROUP = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i of a word holds column order[i]
SHARD_BYTES = 2 << 30


def quantization_config(method: str, group: int = AWQ_GROUP) -> dict:
    """config.json's quantization_config for `method` (AWQ's `group` inputs per scale), as
    AutoAWQ / llm-compressor write it."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "fp8":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "kv_cache_scheme": None,
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "output_activations": None,
                    "weights": {**fp8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**fp8, "strategy": "token", "dynamic": True}}}}
    raise ValueError(f"method {method!r}: awq or fp8")


def awq_tensors(w: torch.Tensor, group: int = AWQ_GROUP) -> dict[str, torch.Tensor]:
    """w [N, K] -> AutoAWQ GEMM's qweight [K, N/8], qzeros [K/group, N/8] int32 and scales
    [K/group, N] float16: min-max asymmetric 4-bit per (output, group of inputs)."""
    n, k = w.shape
    groups = w.float().view(n, k // group, group)
    lo = groups.amin(dim=2).clamp(max=0)
    hi = groups.amax(dim=2).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).half()  # [N, G]
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)  # [N, G]
    q = torch.round(groups / scales.float()[..., None] + zeros[..., None]).clamp(0, 15)
    return {"qweight": _pack_awq(q.view(n, k).t()), "qzeros": _pack_awq(zeros.t()),
            "scales": scales.t().contiguous()}


def _pack_awq(x: torch.Tensor) -> torch.Tensor:
    """[R, C] of 0..15 -> [R, C/8] int32, column 8c + AWQ_ORDER[i] in bits 4i of word c."""
    r, c = x.shape
    nibbles = x.to(torch.int64).view(r, c // 8, 8)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, device=x.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)  # < 2**32: fits, then wraps to int32 below
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def fp8_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> e4m3 weight [N, K] and its float32 weight_scale [N, 1], one per output row."""
    from pagedserve_kernels.reference import FP8_MAX

    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    weight = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": weight, "weight_scale": scale}


def write(preset: str, method: str, out: Path, device: str = "cpu", seed: int = 0,
          group: int = AWQ_GROUP) -> Path:
    """The folder (config.json, safetensors shards and their index) at `out`, which must not
    exist yet."""
    from executor_svc.model_loader import build_hf_model

    quant = quantization_config(method, group)
    hf = build_hf_model(preset, seed=seed, dtype=torch.bfloat16, device=device)
    if hf.config.model_type not in ("llama", "qwen3"):
        raise ValueError(f"preset {preset!r}: only Llama and Qwen3 presets are written")
    convert = (lambda w: awq_tensors(w, group)) if method == "awq" else fp8_tensors
    out.mkdir(parents=True)
    shards, current, size = [], {}, 0
    for name, tensor in hf.state_dict().items():
        module = name.removesuffix(".weight")
        parts = ({f"{module}.{k}": v for k, v in convert(tensor).items()}
                 if name.endswith(".weight") and module.endswith(LINEARS) else {name: tensor})
        for key, value in parts.items():
            current[key] = value.detach().to("cpu", copy=True).contiguous()  # tied: own copies
            size += value.numel() * value.element_size()
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    _save(out, shards, {**hf.config.to_dict(), "architectures": [type(hf).__name__],
                        "torch_dtype": "bfloat16", "quantization_config": quant})
    return out


def _save(out: Path, shards: list[dict], config: dict) -> None:
    from safetensors.torch import save_file

    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--method", choices=("awq", "fp8"), required=True)
    p.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist)")
    p.add_argument("--group", type=int, default=AWQ_GROUP, help="awq: inputs per scale")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are drawn and quantized")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"--out {args.out} exists")
    try:
        write(args.preset, args.method, args.out, args.device, group=args.group)
    except ValueError as err:
        p.error(str(err))
    print(f"wrote {args.method} {args.preset} to {args.out}")


if __name__ == "__main__":
    main()
