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
        head_dim]. Writes this step's K/V into the cache; returns hidden [T, hidden]. The layers'
        parts are the pieces PiecewiseGraphs captures apart around attend()."""
        k_cache, v_cache = kv_caches
        residual, x = self.embed(input_ids), None
        for i in range(len(self.layers)):
            q, residual = self.layer_in(i, x, residual, positions, attn_metadata.slot_mapping,
                                        k_cache[i], v_cache[i])
            out = self.attend(i, q, attn_metadata, k_cache[i], v_cache[i])
            x, residual = self.layer_out(i, out, residual)
        return self.end(x, residual)

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream's start [T, hidden]: the ids' embeddings (scaled where the family
        scales them), into `out` when given. Ours to update in place."""
        if out is None:
            residual = self.embed_tokens[input_ids]  # [T, hidden]: a gather
        else:
            residual = torch.index_select(self.embed_tokens, 0, input_ids, out=out)
        if self.embed_scale is not None:
            residual = residual.mul_(self.embed_scale)  # rounded to the dtype as x * scale is
        return residual

    def layer_in(self, i: int, x, residual: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 qkv_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i up to attention: its input norm (the first layer's over the embeddings; later
        ones fused_add_rms_norm(x, residual): residual += x, rounded to the dtype as
        transformers' `h + out` is, then x = norm(residual), both in place), the QKV product
        (into qkv_out when given), the per-head q/k norms, RoPE and this step's K/V into the
        cache. Returns (q [T, heads, hd], a view into the product, and the residual)."""
        cfg, ops, layer = self.config, self.backend, self.layers[i]
        # feeds: FP8 W8A8 products with per-token scales take their rows quantized by the norm.
        if i == 0:
            x = ops.rms_norm(residual, layer.input_norm, cfg.rms_norm_eps, feeds=layer.qkv_proj)
        else:
            x, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, cfg.rms_norm_eps,
                                                 feeds=layer.qkv_proj)
        num_tokens = residual.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = ops.linear(x, layer.qkv_proj, layer.qkv_bias, out=qkv_out)  # [T, q + 2 * kv]
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
        k_scale, v_scale = self.kv_scales[i]
        ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, k_cache, v_cache,
                                       slot_mapping, interleaved=cfg.rope_interleaved,
                                       k_scale=k_scale, v_scale=v_scale)
        return q, residual

    def attend(self, i: int, q: torch.Tensor, md: AttentionMetadata, k_cache: torch.Tensor,
               v_cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention of q [T, heads, hd] over the paged cache -> [T, heads, hd] (into
        `out` when given): the decode kernel, the prefill kernel, or in a mixed step the decode
        kernel for its leading one-token seqs and the prefill kernel for the rest."""
        k_scale, v_scale = self.kv_scales[i]
        features = dict(sliding_window=self.layers[i].window,
                        soft_cap=self.config.attn_logit_softcapping, k_scale=k_scale,
                        v_scale=v_scale)
        ops = self.backend
        if md.is_decode_only:
            return ops.paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                              self.scale, out=out, **features)
        if md.prefill is None:
            return ops.paged_prefill_attention(q, k_cache, v_cache, md.block_tables,
                                               md.cu_seqlens_q, md.seq_lens, self.scale, out=out,
                                               **features)
        d, p = md.num_decodes, md.prefill
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, heads, hd]
        ops.paged_decode_attention(q[:d], k_cache, v_cache, md.block_tables[:d], md.seq_lens[:d],
                                   self.scale, out=out[:d], **features)
        ops.paged_prefill_attention(q[d:], k_cache, v_cache, p.block_tables, p.cu_seqlens_q,
                                    p.seq_lens, self.scale, out=out[d:], **features)
        return out

    def layer_out(self, i: int, attn: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after attention (attn: [T, heads, hd]): the output product, the post-attention
        norm with the residual add, the MLP, and the families' extra norms. Returns (x, residual
        updated in place)."""
        cfg, ops, layer = self.config, self.backend, self.layers[i]
        num_tokens = attn.shape[0]
        x = ops.linear(attn.reshape(num_tokens, cfg.num_heads * cfg.head_dim), layer.o_proj,
                       layer.o_bias)
        if layer.attn_out_norm is not None:  # GLM-4, Gemma: normed before the residual add
            x = ops.rms_norm(x, layer.attn_out_norm, cfg.rms_norm_eps)
        x, residual = ops.fused_add_rms_norm(x, residual, layer.post_attention_norm,
                                             cfg.rms_norm_eps, feeds=layer.gate_up_proj)
        x = self._mlp(x, layer)
        if layer.mlp_out_norm is not None:
            x = ops.rms_norm(x, layer.mlp_out_norm, cfg.rms_norm_eps)
        return x, residual

    def end(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final norm over the last layer's output and the residual -> hidden [T, hidden]."""
        x, _ = self.backend.fused_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
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
