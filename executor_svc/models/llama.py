"""The shared decoder of every supported family (Llama 2/3, Mistral, Qwen2/3, Phi-3, GLM/GLM-4,
Gemma 2/3) over the paged KV cache, gpt-fast style: plain weight tensors, every GEMM and kernel
through the backend's ops; the families differ only in the optional parts their config switches
on. Imports torch only (plus the backend protocol for typing).
"""
from __future__ import annotations

import torch

from executor_svc.attention_metadata import AttentionMetadata
from executor_svc.model_config import LongRope, ModelConfig
from executor_svc.models.rope import rope_tables
from executor_svc.models.weights import LayerWeights, layer_weights, norm_weight


class LlamaModel:
    """Forward pass over a packed batch of tokens of many sequences and the paged KV cache."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend) -> None:
        """weights: transformers state-dict names (model.layers.N.self_attn.q_proj.weight, ...),
        already in the target dtype and on the backend's device."""
        backend.check_model(config)  # a feature the backend lacks stops the load, never the output
        self.config = config
        self.backend = backend
        self.embed_tokens = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.norm = norm_weight(weights["model.norm.weight"], config)  # [hidden]
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = weights["lm_head.weight"]  # [vocab, hidden]
        self.layers = [layer_weights(weights, i, config) for i in range(config.num_layers)]
        self.kv_scales = [_kv_scales(weights, i, backend.device) for i in range(config.num_layers)]
        self.scale = config.attn_scale
        self.embed_scale = None
        if config.embed_scale is not None:  # rounded to the dtype, as transformers' normalizer
            self.embed_scale = torch.tensor(config.embed_scale, dtype=self.embed_tokens.dtype,
                                            device=backend.device)
        rotary_dim = config.rotary_dim or config.head_dim
        scaling = config.rope_scaling
        long = (isinstance(scaling, LongRope)
                and config.max_position_embeddings > scaling.original_max_position_embeddings)
        cos, sin = rope_tables(rotary_dim, config.rope_theta, scaling,
                               config.max_position_embeddings, long)
        self.rope_cos = cos.to(backend.device)  # [max_pos, rotary_dim] float32
        self.rope_sin = sin.to(backend.device)
        self.local_rope_cos, self.local_rope_sin = self.rope_cos, self.rope_sin
        if config.local_rope_theta is not None:  # Gemma 3's windowed layers: their own base
            cos, sin = rope_tables(rotary_dim, config.local_rope_theta, None,
                                   config.max_position_embeddings)
            self.local_rope_cos, self.local_rope_sin = cos.to(backend.device), sin.to(backend.device)

    def set_max_model_len(self, max_model_len: int) -> None:
        """LongRoPE takes one factor set for the whole server, as vLLM: the long factors when a
        sequence may pass the original context (max_model_len > original_max_position_embeddings),
        else the short ones; a seq crossing that length keeps the keys already in its cache.
        (transformers chooses per forward call by the sequence's current length instead.)"""
        scaling = self.config.rope_scaling
        if not isinstance(scaling, LongRope):
            return
        long = max_model_len > scaling.original_max_position_embeddings
        cos, sin = rope_tables(self.config.rotary_dim or self.config.head_dim,
                               self.config.rope_theta, scaling,
                               self.config.max_position_embeddings, long)
        self.rope_cos.copy_(cos)  # in place: a captured graph keeps these addresses
        self.rope_sin.copy_(sin)

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
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        # feeds: FP8 W8A8 products with per-token scales take their rows quantized by the norm.
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps,
                         feeds=self.layers[0].qkv_proj)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            if i > 0:
                x, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, eps,
                                                     feeds=layer.qkv_proj)
            x = self._attention(x, layer, positions, attn_metadata, k_cache[i], v_cache[i],
                                self.kv_scales[i])
            if layer.attn_out_norm is not None:  # GLM-4, Gemma: normed before the residual add
                x = ops.rms_norm(x, layer.attn_out_norm, eps)
            x, residual = ops.fused_add_rms_norm(x, residual, layer.post_attention_norm, eps,
                                                 feeds=layer.gate_up_proj)
            x = self._mlp(x, layer)
            if layer.mlp_out_norm is not None:
                x = ops.rms_norm(x, layer.mlp_out_norm, eps)
        x, _ = ops.fused_add_rms_norm(x, residual, self.norm, eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, hidden] (only the rows to sample) -> logits [n, vocab] float32, into `out`
        when given (its cast from the model's dtype is the copy that .float() would make)."""
        logits = self.backend.linear(hidden, self.lm_head)  # [n, vocab], the model's dtype
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2, in the model's dtype as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if out is None else out.copy_(logits)

    def _attention(self, x, layer, positions, md, k_cache, v_cache, kv_scales) -> torch.Tensor:
        cfg, ops = self.config, self.backend
        k_scale, v_scale = kv_scales
        num_tokens = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = ops.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        # Views into qkv (strided): RoPE rotates q and k where they lie.
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, heads, hd]
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, kv_heads, hd]
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, kv_heads, hd]
        if layer.q_norm is not None:  # per-head RMSNorm (Qwen3, Gemma 3), in place in qkv
            ops.head_rms_norm(q, k, layer.q_norm, layer.k_norm, cfg.rms_norm_eps)
        local = layer.window is not None
        cos = self.local_rope_cos if local else self.rope_cos
        sin = self.local_rope_sin if local else self.rope_sin
        ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, k_cache, v_cache,
                                       md.slot_mapping, interleaved=cfg.rope_interleaved,
                                       k_scale=k_scale, v_scale=v_scale)
        features = dict(sliding_window=layer.window, soft_cap=cfg.attn_logit_softcapping,
                        k_scale=k_scale, v_scale=v_scale)
        if md.is_decode_only:
            out = ops.paged_decode_attention(
                q, k_cache, v_cache, md.block_tables, md.seq_lens, self.scale, **features
            )
        elif md.prefill is not None:  # mixed: the leading one-token seqs, then the rest
            out = self._mixed_attention(q, md, k_cache, v_cache, features)
        else:
            out = ops.paged_prefill_attention(
                q, k_cache, v_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, self.scale,
                **features
            )  # [T, heads, hd]
        return ops.linear(out.reshape(num_tokens, q_size), layer.o_proj, layer.o_bias)

    def _mixed_attention(self, q, md, k_cache, v_cache, features) -> torch.Tensor:
        """q: [T, heads, hd]; its first md.num_decodes rows are one token of their own seq."""
        d, p = md.num_decodes, md.prefill
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, heads, hd]
        self.backend.paged_decode_attention(q[:d], k_cache, v_cache, md.block_tables[:d],
                                            md.seq_lens[:d], self.scale, out=out[:d], **features)
        self.backend.paged_prefill_attention(q[d:], k_cache, v_cache, p.block_tables,
                                             p.cu_seqlens_q, p.seq_lens, self.scale, out=out[d:],
                                             **features)
        return out

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate_up = self.backend.linear(x, layer.gate_up_proj)  # [T, 2 * intermediate], gate | up
        if self.config.hidden_act == "gelu_tanh":  # GeGLU (Gemma)
            act = self.backend.gelu_tanh_and_mul(gate_up)  # [T, intermediate]
        else:
            act = self.backend.silu_and_mul(gate_up, feeds=layer.down_proj)  # [T, intermediate]
        return self.backend.linear(act, layer.down_proj)  # [T, hidden]

    def linear_groups(self) -> dict[str, list[torch.Tensor]]:
        """The weights of each GEMM of the forward, one list per product (a tuner's groups)."""
        return {"qkv": [layer.qkv_proj for layer in self.layers],
                "o": [layer.o_proj for layer in self.layers],
                "gate_up": [layer.gate_up_proj for layer in self.layers],
                "down": [layer.down_proj for layer in self.layers],
                "lm_head": [self.lm_head]}


def _kv_scales(weights: dict, i: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's (k_scale, v_scale), [] float32 on `device`: the checkpoint's where its
    quantization carries them (executor_svc.quantization.kv_cache), else 1.0 (vLLM's default).
    Only an FP8 KV cache reads them."""
    prefix = f"model.layers.{i}.self_attn.attn."
    one = torch.ones((), dtype=torch.float32)
    return tuple(weights.get(prefix + name, one).to(device=device, dtype=torch.float32)
                 for name in ("k_scale", "v_scale"))
