"""A compact Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache,
gpt-fast style: plain weight tensors, every GEMM and kernel through the backend's ops.
Imports torch only (plus the backend protocol for typing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import AttentionMetadata
from executor_svc.model_config import ModelConfig, RopeScaling


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden], q|k|v fused
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    o_proj: torch.Tensor  # [hidden, heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden], gate|up fused
    down_proj: torch.Tensor  # [hidden, intermediate]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with llama3 band scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaModel:
    """Forward pass over a packed batch of tokens of many sequences and the paged KV cache."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend) -> None:
        """weights: transformers state-dict names (model.layers.N.self_attn.q_proj.weight, ...),
        already in the target dtype and on the backend's device."""
        self.config = config
        self.backend = backend
        self.embed_tokens = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.norm = weights["model.norm.weight"]  # [hidden]
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = weights["lm_head.weight"]  # [vocab, hidden]
        self.layers = [_layer_weights(weights, i, config) for i in range(config.num_layers)]
        self.scale = config.head_dim**-0.5
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.rope_cos = emb.cos().to(backend.device)  # [max_pos, head_dim] float32
        self.rope_sin = emb.sin().to(backend.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: K and V, [layers, blocks, kv_heads, block_size,
        head_dim]. Writes this step's K/V into the cache; returns hidden [T, hidden]."""
        k_cache, v_cache = kv_caches
        ops, eps = self.backend, self.config.rms_norm_eps
        # fused_add_rms_norm(x, residual): residual += x, rounded to the dtype as transformers'
        # `h + out` is, then x = norm(residual); both in place.
        residual = self.embed_tokens[input_ids]  # [T, hidden]: a gather, ours to update in place
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            if i > 0:
                x, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, eps)
            x = self._attention(x, layer, positions, attn_metadata, k_cache[i], v_cache[i])
            x, residual = ops.fused_add_rms_norm(x, residual, layer.post_attention_norm, eps)
            x = self._mlp(x, layer)
        x, _ = ops.fused_add_rms_norm(x, residual, self.norm, eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, hidden] (only the rows to sample) -> logits [n, vocab] float32, into `out`
        when given (its cast from the model's dtype is the copy that .float() would make)."""
        logits = self.backend.linear(hidden, self.lm_head)  # [n, vocab], the model's dtype
        return logits.float() if out is None else out.copy_(logits)

    def _attention(self, x, layer, positions, md, k_cache, v_cache) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = self.backend.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        # Views into qkv (strided): RoPE rotates q and k where they lie.
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, heads, hd]
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, kv_heads, hd]
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, kv_heads, hd]
        self.backend.rotary_embedding_and_cache(positions, q, k, v, self.rope_cos, self.rope_sin,
                                                k_cache, v_cache, md.slot_mapping)
        if md.is_decode_only:
            out = self.backend.paged_decode_attention(
                q, k_cache, v_cache, md.block_tables, md.seq_lens, self.scale
            )
        elif md.prefill is not None:  # mixed: the leading one-token seqs, then the rest
            out = self._mixed_attention(q, md, k_cache, v_cache)
        else:
            out = self.backend.paged_prefill_attention(
                q, k_cache, v_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, self.scale
            )  # [T, heads, hd]
        return self.backend.linear(out.reshape(num_tokens, q_size), layer.o_proj)  # [T, hidden]

    def _mixed_attention(self, q, md, k_cache, v_cache) -> torch.Tensor:
        """q: [T, heads, hd]; its first md.num_decodes rows are one token of their own seq."""
        d, p = md.num_decodes, md.prefill
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, heads, hd]
        self.backend.paged_decode_attention(q[:d], k_cache, v_cache, md.block_tables[:d],
                                            md.seq_lens[:d], self.scale, out=out[:d])
        self.backend.paged_prefill_attention(q[d:], k_cache, v_cache, p.block_tables,
                                             p.cu_seqlens_q, p.seq_lens, self.scale, out=out[d:])
        return out

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate_up = self.backend.linear(x, layer.gate_up_proj)  # [T, 2 * intermediate], gate | up
        act = self.backend.silu_and_mul(gate_up)  # [T, intermediate]
        return self.backend.linear(act, layer.down_proj)  # [T, hidden]

    def linear_groups(self) -> dict[str, list[torch.Tensor]]:
        """The weights of each GEMM of the forward, one list per product (a tuner's groups)."""
        return {"qkv": [layer.qkv_proj for layer in self.layers],
                "o": [layer.o_proj for layer in self.layers],
                "gate_up": [layer.gate_up_proj for layer in self.layers],
                "down": [layer.down_proj for layer in self.layers],
                "lm_head": [self.lm_head]}


def _layer_weights(weights: dict[str, torch.Tensor], i: int, cfg: ModelConfig) -> LayerWeights:
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    qkv_bias = None
    if cfg.attention_bias:
        qkv_bias = torch.cat([weights[attn + f"{n}_proj.bias"] for n in "qkv"])
    return LayerWeights(
        input_norm=weights[p + "input_layernorm.weight"],
        qkv_proj=torch.cat([weights[attn + f"{n}_proj.weight"] for n in "qkv"]),
        qkv_bias=qkv_bias,
        o_proj=weights[attn + "o_proj.weight"],
        post_attention_norm=weights[p + "post_attention_layernorm.weight"],
        gate_up_proj=torch.cat(
            [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
        ),
        down_proj=weights[p + "mlp.down_proj.weight"],
    )
