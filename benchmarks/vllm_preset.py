"""vLLM's offline_bench.py (../shared/bench/vllm, in --vllm-dir on the GPU machine) on a preset's
shape: its Llama-3-8B CONFIG and VOCAB replaced by the preset written as its model's config.json
(architectures and model_type as the real model's, so vLLM builds its own Qwen3ForCausalLM or
Glm4ForCausalLM), then its main() with every other argument.

    python3 benchmarks/vllm_preset.py --preset qwen3-8b --vllm-dir /tmp/vllm_parts \\
        --workloads W1 --out vllm.json

Its requests are then bench_serving's for `--model preset:NAME` (lengths from random.Random(0),
ids from random.Random(1) below the preset's vocab_size), and the workloads offline_bench lacks
come from benchmarks/workloads.py. `--quantization awq|fp8` adds quant_folder.py's
quantization_config (vLLM's dummy weights take that layout: awq_marlin, or compressed-tensors
FP8), `--kv-cache-dtype fp8` vLLM's FP8 KV cache. `--print-config` prints the config.json and
exits (no vLLM, no GPU).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

# model_type -> vLLM's class for it; the presets of other families are not written.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "glm4": "Glm4ForCausalLM"}


def hub_config(preset: str) -> dict:
    """The preset as its model's config.json, in the keys the hub's files use (rope_theta and
    torch_dtype at the top level); llama3-8b gives offline_bench's own CONFIG."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from executor_svc.model_config import ModelConfig, preset_hf_config

    hf = preset_hf_config(preset)
    c = ModelConfig.from_hf_config(hf)
    if c.architecture not in ARCHITECTURES or c.rope_scaling or c.layer_windows:
        raise ValueError(f"preset {preset!r}: only unscaled, unwindowed "
                         f"{'/'.join(ARCHITECTURES)} presets are written for vLLM")
    eos = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_id
    config = {
        "architectures": [ARCHITECTURES[c.architecture]], "model_type": c.architecture,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "bfloat16",
        "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
        "bos_token_id": c.bos_token_id, "eos_token_id": eos,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias,
    }
    config = {k: v for k, v in config.items() if v is not None}  # GLM-4's has no bos_token_id
    config.update(_family_keys(hf, c))
    return config


def _family_keys(hf, c) -> dict:
    if c.architecture == "llama":
        return {"mlp_bias": False}
    if c.architecture == "qwen3":
        return {"max_window_layers": c.num_layers, "use_sliding_window": False,
                "sliding_window": None, "rope_scaling": None}
    return {"partial_rotary_factor": c.rotary_dim / c.head_dim,  # glm4
            "pad_token_id": hf.pad_token_id}


def load_offline_bench(vllm_dir: Path) -> ModuleType:
    path = vllm_dir / "offline_bench.py"
    if not path.is_file():
        raise FileNotFoundError(f"--vllm-dir {vllm_dir}: no offline_bench.py there "
                                "(../shared/bench/vllm/install_on_gpu.sh leaves it in "
                                "/tmp/vllm_parts)")
    spec = importlib.util.spec_from_file_location("offline_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--vllm-dir", type=Path, default=Path("/tmp/vllm_parts"))
    p.add_argument("--quantization", choices=("awq", "fp8"), default=None,
                   help="the layout of quant_folder.py --method (vLLM runs dummy weights of it)")
    p.add_argument("--kv-cache-dtype", default=None, help="vLLM's engine argument (fp8)")
    p.add_argument("--print-config", action="store_true", help="print the config.json, run nothing")
    args, rest = p.parse_known_args(argv)
    try:
        config = hub_config(args.preset)
    except ValueError as err:
        p.error(str(err))
    if args.quantization:
        from benchmarks.quant_folder import quantization_config

        config["quantization_config"] = quantization_config(args.quantization)
    if args.print_config:
        print(json.dumps(config, indent=1))
        return
    try:
        bench = load_offline_bench(args.vllm_dir)
    except FileNotFoundError as err:
        p.error(str(err))
    from benchmarks.workloads import WORKLOADS

    bench.CONFIG, bench.VOCAB = config, config["vocab_size"]  # make_requests reads VOCAB
    bench.WORKLOADS = {**WORKLOADS, **bench.WORKLOADS}
    if args.kv_cache_dtype:
        _add_engine_args(bench, kv_cache_dtype=args.kv_cache_dtype)
    sys.argv = [str(args.vllm_dir / "offline_bench.py"), *rest]
    bench.main()


def _add_engine_args(bench: ModuleType, **extra) -> None:
    """offline_bench builds LLM(**engine_args) from `vllm` once its site is on the path: the
    engine gets `extra` too."""
    use_site = bench.use_vllm_site

    def use_site_then_wrap() -> None:
        use_site()
        import vllm

        llm = vllm.LLM
        vllm.LLM = lambda **engine_args: llm(**engine_args, **extra)

    bench.use_vllm_site = use_site_then_wrap


if __name__ == "__main__":
    main()
