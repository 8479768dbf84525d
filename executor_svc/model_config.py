"""ModelConfig (the shape of a supported decoder and its family's quirks) and named presets
built as transformers configs. Imports transformers config classes only; no weights.
"""
from __future__ import annotations

import dataclasses
import json
import math
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
class LinearRope:
    """Linear RoPE scaling: every frequency divided by `factor` (Gemma 3's global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRope:
    """LongRoPE / su scaling (Phi-3): per-frequency short and long factors, and the attention
    factor transformers multiplies into cos and sin."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


# model_type -> the family's name in messages; the order is the README's.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "glm", "glm4", "gemma2",
                         "gemma3_text")


def check_model_type(model_type: str | None) -> None:
    """Raises ValueError naming the supported model types for any other."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; pagedserve serves "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a model_type of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | LinearRope | LongRope | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2, GLM)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mistral-style local attention window on every layer; None = full attention. Served as
    # full attention up to the window (max_context), not as a window.
    sliding_window: int | None = None
    # Per-layer windows computed as windows (Gemma 2/3, Qwen3 with use_sliding_window): a query
    # of layer i sees its layer_windows[i] most recent positions; None = full. () = all full.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE of the windowed layers where it differs (Gemma 3: its own base, no scaling).
    local_rope_theta: float | None = None
    rotary_dim: int | None = None  # the rotated leading dims of a head; None = head_dim
    rope_interleaved: bool = False  # pairs (2i, 2i + 1) (GLM), else rotate-half
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh" (GeGLU, Gemma)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs (GLM-4, Gemma 2/3)
    embed_scale: float | None = None  # embeddings times sqrt(hidden) (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(it); None = head_dim
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # Gemma 2
    quantization: str | None = None  # the checkpoint's, e.g. "awq int4 g128"; None: dense weights

    @property
    def max_context(self) -> int:
        """Longest sequence this forward pass computes exactly: no longer than a Mistral-style
        global window (served as full attention, beyond it the model would attend to fewer)."""
        limit = self.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, i: int) -> int | None:
        return self.layer_windows[i] if self.layer_windows else None

    def to_json(self) -> str:
        """The config as JSON, its RoPE scaling tagged with its kind (from_json reads it back)."""
        fields = dataclasses.asdict(self)
        if self.rope_scaling is not None:
            fields["rope_scaling"] = {"kind": type(self.rope_scaling).__name__,
                                      **fields["rope_scaling"]}
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        fields = json.loads(text)
        rope = fields.get("rope_scaling")
        if rope is not None:
            kind = {c.__name__: c for c in (RopeScaling, LinearRope, LongRope)}[rope.pop("kind")]
            fields["rope_scaling"] = kind(**{k: tuple(v) if isinstance(v, list) else v
                                             for k, v in rope.items()})
        for name in ("eos_token_ids", "layer_windows"):
            fields[name] = tuple(fields[name])
        return cls(**fields)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelConfig":
        """From a transformers config of a supported model_type (v4 or v5 rope fields)."""
        arch = cfg.model_type
        check_model_type(arch)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = _rope_params(cfg, "full_attention")
        common = dict(
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
            rope_scaling=_rope_scaling(rope, cfg),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            bos_token_id=cfg.bos_token_id,
            eos_token_ids=_token_ids(cfg.eos_token_id),
            rotary_dim=_rotary_dim(rope, cfg, head_dim),
        )
        return cls(**common, **_FAMILY_FIELDS.get(arch, _llama_fields)(cfg))


def from_gguf(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]],
              rope_factors: dict[str, list[float]]) -> ModelConfig:
    """The config of a GGUF file from its metadata (llama.cpp's keys), its tensors' shapes
    (llama.cpp's names, numpy order) and its RoPE factor tensors (rope_freqs, rope_factors_long,
    rope_factors_short), as llama.cpp's loader reads them. Raises ValueError naming the key."""
    arch = metadata["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; pagedserve loads "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    key = _GgufKeys(metadata, arch)
    hidden, heads = key.count("embedding_length"), key.count("attention.head_count")
    head_dim = key.count("attention.key_length", hidden // heads)
    rotary_dim = key.count("rope.dimension_count", head_dim)
    common = dict(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=key.count("feed_forward_length"),
        num_layers=key.count("block_count"),
        num_heads=heads,
        num_kv_heads=key.count("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=key.number("attention.layer_norm_rms_epsilon"),
        rope_theta=key.number("rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(key, rope_factors),
        max_position_embeddings=key.count("context_length"),
        # llama.cpp writes no output tensor when the head is the embedding matrix
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes or "blk.0.attn_qkv.bias" in shapes,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_token_ids(metadata.get("tokenizer.ggml.eos_token_id")),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
    )
    return ModelConfig(**common, **_GGUF_FAMILY_FIELDS.get(arch, lambda k, c: {})(key, common))


# general.architecture -> model_type; "chatglm" (GlmForCausalLM) is left out: llama.cpp's
# converter writes the hidden size as its context length and a fixed 1e-5 as its norm epsilon.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "glm4": "glm4", "gemma2": "gemma2", "gemma3": "gemma3_text"}


class _GgufKeys:
    """One architecture's metadata keys ("{arch}.{name}"), each read as its type."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def get(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    def count(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if isinstance(value, list):  # per-layer counts: the decoder takes one for all layers
            if len(set(value)) != 1:
                raise ValueError(f"{self.arch}.{name} differs between layers ({value[:8]}...); "
                                 "pagedserve serves one value for every layer")
            value = value[0]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"GGUF metadata {self.arch}.{name} must be a positive integer, "
                             f"got {value!r}")
        return value

    def number(self, name: str, default: float | None = None) -> float:
        value = self.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"GGUF metadata {self.arch}.{name} must be a positive number, "
                             f"got {value!r}")
        return float(value)


def _gguf_rope_scaling(key: _GgufKeys, factors: dict[str, list[float]]):
    """rope.scaling.type as llama.cpp reads it; llama3-type scaling travels as per-frequency
    divisors (the rope_freqs tensor), which LongRope's form computes exactly."""
    kind = key.get("rope.scaling.type", "none")
    if "rope_freqs" in factors:
        freqs = tuple(factors["rope_freqs"])
        return LongRope(short_factor=freqs, long_factor=freqs,
                        original_max_position_embeddings=key.count("context_length"),
                        attention_factor=1.0)
    # Phi-3's converter writes no scaling type: the factor tensors are the LongRoPE
    if {"rope_factors_long", "rope_factors_short"} <= set(factors):
        return LongRope(short_factor=tuple(factors["rope_factors_short"]),
                        long_factor=tuple(factors["rope_factors_long"]),
                        original_max_position_embeddings=key.count(
                            "rope.scaling.original_context_length"),
                        attention_factor=key.number("rope.scaling.attn_factor", 1.0))
    if kind == "none":
        return None
    if kind == "linear":
        return LinearRope(factor=key.number("rope.scaling.factor"))
    raise ValueError(f"unsupported GGUF rope scaling {kind!r} (none, linear, llama3 factors and "
                     "longrope with its factor tensors only)")


def _gguf_gemma_fields(key: _GgufKeys, common: dict) -> dict:
    """llama.cpp fixes what the file does not say: every 2nd (Gemma 2) or 6th (Gemma 3) layer is
    global, Gemma 3's local layers rotate at base 10000 unscaled, and the attention scale is
    1/sqrt(hidden / heads) for the 27B models (by layer count), else 1/sqrt(head_dim)."""
    gemma2 = key.arch == "gemma2"
    layers, window = common["num_layers"], key.get("attention.sliding_window") or None
    period = 2 if gemma2 else 6
    windows = tuple(None if (i + 1) % period == 0 else int(window) for i in range(layers))
    is_27b = layers == (46 if gemma2 else 62)
    fields = dict(
        hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=common["hidden_size"] ** 0.5,
        # llama.cpp's converter stored 1 + w: the norms scale by the stored weight
        norm_plus_one=False,
        query_pre_attn_scalar=float(common["hidden_size"] // common["num_heads"] if is_27b
                                    else common["head_dim"]),
        attn_logit_softcapping=_optional_float(key.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(key.get("final_logit_softcapping")),
        layer_windows=windows if window else (),
    )
    if not gemma2:
        fields.update(qk_norm=True, attn_logit_softcapping=None,
                      local_rope_theta=key.number("rope.freq_base_swa", 10000.0))
    return fields


_GGUF_FAMILY_FIELDS: dict[str, Callable[[_GgufKeys, dict], dict]] = {
    "qwen3": lambda key, common: dict(qk_norm=True),
    "phi3": lambda key, common: dict(sliding_window=key.get("attention.sliding_window") or None),
    "glm4": lambda key, common: dict(rope_interleaved=True, sandwich_norms=True),
    "gemma2": _gguf_gemma_fields, "gemma3": _gguf_gemma_fields,
}


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _rotary_dim(rope: dict, cfg: Any, head_dim: int) -> int | None:
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if factor is None or float(factor) == 1.0:
        return None
    return int(head_dim * float(factor))


def _llama_fields(cfg: Any) -> dict:
    """Llama, Mistral, Qwen2: a Qwen2 window applies only with use_sliding_window."""
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        window = None
    return dict(sliding_window=int(window) if window else None)


def _layer_windows(cfg: Any) -> tuple[int | None, ...]:
    """transformers' layer_types: "sliding_attention" layers see cfg.sliding_window positions."""
    types = getattr(cfg, "layer_types", None) or ()
    window = getattr(cfg, "sliding_window", None)
    if not window or "sliding_attention" not in types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _qwen3_fields(cfg: Any) -> dict:
    return dict(qk_norm=True, layer_windows=_layer_windows(cfg))


def _phi3_fields(cfg: Any) -> dict:
    return _llama_fields(cfg)


def _glm_fields(cfg: Any) -> dict:
    return dict(rope_interleaved=True, sandwich_norms=cfg.model_type == "glm4")


def _gemma_fields(cfg: Any) -> dict:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {act!r} for {cfg.model_type} "
                         "(gelu_pytorch_tanh only)")
    fields = dict(
        hidden_act="gelu_tanh", norm_plus_one=True, sandwich_norms=True,
        embed_scale=cfg.hidden_size**0.5, query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        attn_logit_softcapping=_optional_float(getattr(cfg, "attn_logit_softcapping", None)),
        final_logit_softcapping=_optional_float(getattr(cfg, "final_logit_softcapping", None)),
        layer_windows=_layer_windows(cfg),
    )
    if cfg.model_type == "gemma3_text":
        local = _rope_params(cfg, "sliding_attention")
        if _rope_scaling(local, cfg) is not None:
            raise ValueError("unsupported rope scaling on gemma3's sliding layers")
        fields.update(qk_norm=True, local_rope_theta=float(local.get("rope_theta", 10000.0)))
    return fields


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


_FAMILY_FIELDS: dict[str, Callable[[Any], dict]] = {
    "qwen3": _qwen3_fields, "phi3": _phi3_fields, "glm": _glm_fields, "glm4": _glm_fields,
    "gemma2": _gemma_fields, "gemma3_text": _gemma_fields,
}


def _rope_params(cfg: Any, layer_type: str) -> dict:
    # transformers 5 keeps theta and scaling in `rope_parameters` (per layer type for Gemma 3);
    # 4.x in rope_theta/rope_scaling.
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if layer_type in params:
        params = dict(params[layer_type] or {})
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None) is not None:
        params["rope_theta"] = cfg.rope_theta
    legacy = getattr(cfg, "rope_scaling", None)
    if legacy and "rope_type" not in params:
        params.update(legacy)
    return params


def _rope_scaling(params: dict, cfg: Any):
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return LinearRope(factor=float(params["factor"]))
    if rope_type in ("longrope", "su"):
        return _long_rope(params, cfg)
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r} (default, linear, llama3 and "
                         "longrope only)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.max_position_embeddings)
        ),
    )


def _long_rope(params: dict, cfg: Any) -> LongRope:
    """As transformers' _compute_longrope_parameters: `factor` defaults to max / original
    positions, and the attention factor to sqrt(1 + ln(factor) / ln(original))."""
    original = int(params.get("original_max_position_embeddings")
                   or getattr(cfg, "original_max_position_embeddings", None)
                   or cfg.max_position_embeddings)
    factor = params.get("factor") or cfg.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return LongRope(short_factor=tuple(float(f) for f in params["short_factor"]),
                    long_factor=tuple(float(f) for f in params["long_factor"]),
                    original_max_position_embeddings=original,
                    attention_factor=float(attention_factor))


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


def _qwen3_8b() -> Any:
    """Qwen/Qwen3-8B's config.json (untied, no windows: use_sliding_window false)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, max_window_layers=36, use_sliding_window=False,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=151643, eos_token_id=151645,
    )


def _glm4_9b() -> Any:
    """THUDM/GLM-4-9B-0414's config.json: two KV heads, QKV bias, half of each head rotated."""
    from transformers import Glm4Config

    return Glm4Config(
        vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=32768, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=True,
        pad_token_id=151329, eos_token_id=[151329, 151336, 151338],
    )


PRESETS: dict[str, Callable[[], Any]] = {
    "tiny": _tiny,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-llama3": _tiny_llama3,
    "smollm2-135m": _smollm2_135m,
    "llama3-8b": _llama3_8b,
    "qwen3-8b": _qwen3_8b,
    "glm4-9b": _glm4_9b,
}


def preset_hf_config(name: str) -> Any:
    """The transformers config of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
