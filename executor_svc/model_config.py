"""ModelConfig (the shape of a Llama-family decoder) and named presets built as transformers
configs. Imports transformers config classes only; no weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class RopeScaling:
    """llama3-type RoPE frequency scaling (Llama 3.1+)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mistral-style local attention window; None = full attention.
    sliding_window: int | None = None

    @property
    def max_context(self) -> int:
        """Longest sequence this forward pass computes exactly: full attention only, so no
        longer than the sliding window (beyond it the model would attend to fewer tokens)."""
        limit = self.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelConfig":
        """From a transformers LlamaConfig / Qwen2Config / MistralConfig (v4 or v5 rope fields)."""
        arch = cfg.model_type
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r}: Llama-family decoders only")
        rope = _rope_params(cfg)
        eos = cfg.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(rope, cfg.max_position_embeddings),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            bos_token_id=cfg.bos_token_id,
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(cfg),
        )


def _sliding_window(cfg: Any) -> int | None:
    """Qwen2 configs carry a window that only applies with use_sliding_window."""
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        return None
    return int(window) if window else None


def _rope_params(cfg: Any) -> dict:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None) is not None:
        params["rope_theta"] = cfg.rope_theta
    legacy = getattr(cfg, "rope_scaling", None)
    if legacy and "rope_type" not in params:
        params.update(legacy)
    return params


def _rope_scaling(params: dict, max_positions: int) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r} (default and llama3 only)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_positions)
        ),
    )


# Presets: transformers configs, so that tests can build the identical HF model. The tiny ones
# keep SmolLM2's vocabulary (49152, bos 1, eos 2) so SmolLM2's tokenizer works with them.
_TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    # Wide random weights so greedy decoding wanders instead of repeating one token, which
    # makes token-for-token comparisons meaningful.
    initializer_range=0.3,
)


def _tiny() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY, rope_theta=100000.0, tie_word_embeddings=True)


def _tiny_qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_TINY, rope_theta=1000000.0, tie_word_embeddings=True)


def _tiny_llama3() -> Any:
    from transformers import LlamaConfig

    # original_max 256 so that the tiny head_dim spans all three llama3 frequency bands.
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256)
    return LlamaConfig(**_TINY, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=False)


def _smollm2_135m() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def _llama3_8b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    )


PRESETS: dict[str, Callable[[], Any]] = {
    "tiny": _tiny,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-llama3": _tiny_llama3,
    "smollm2-135m": _smollm2_135m,
    "llama3-8b": _llama3_8b,
}


def preset_hf_config(name: str) -> Any:
    """The transformers config of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
