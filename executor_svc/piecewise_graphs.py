"""PiecewiseGraphs: the steps no full-step graph holds (a prompt chunk beside many decodes), run
layer by layer: the forward between two attentions is a CUDA graph per token count, and attention,
whose launches follow the step's seqs, runs eagerly between them (vLLM's piecewise graphs).
Imports torch only.
"""
from __future__ import annotations

import logging
import time

import torch

from executor_svc.attention_metadata import AttentionMetadata
from pagedserve_kernels import graph_capture

log = logging.getLogger(__name__)


class PiecewiseGraphs:
    """Captured pieces of `model`'s forward for steps padded to one of `token_sizes`: piece 0
    the embeddings to layer 0's attention input (LlamaModel.embed, layer_in), piece i layer
    i-1's rest and layer i's input (layer_out, layer_in), piece L (the layer count) the last
    layer's rest and the final norm (end).

    What crosses an attention lies in static buffers: the residual stream, the QKV product
    (attention reads its q rows; the piece wrote k and v into the cache), attention's output and
    the final hidden states. Pad tokens write no cache slot (-1) and are never attended; their
    rows hold whatever the buffers held, and every op but attention works row by row, so they
    never reach a real row (save an FP8 product with a dynamic per-tensor scale: its amax spans
    the pad rows as it spans the step's other seqs). Tests on the CPU replace `graphs` with eager
    calls of step()."""

    def __init__(self, model, kv_caches, token_sizes: tuple[int, ...]) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.token_sizes = tuple(sorted(token_sizes))
        self.max_tokens = self.token_sizes[-1] if self.token_sizes else 0
        self.num_pieces = len(model.layers) + 1
        cfg, t = model.config, self.max_tokens
        device, dtype = kv_caches[0].device, model.embed_tokens.dtype
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)  # [t]
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(t, q_size + 2 * kv_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(t, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=device)
        self._q_size = q_size
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    @staticmethod
    def buffer_bytes(config, max_tokens: int, dtype_bytes: int) -> int:
        """What the static buffers of a ladder up to max_tokens take (the memory profile's)."""
        q_size, kv_size = (config.num_heads * config.head_dim,
                           config.num_kv_heads * config.head_dim)
        rows = 2 * config.hidden_size + 2 * q_size + 2 * kv_size  # residual, hidden, qkv, out
        return max_tokens * (rows * dtype_bytes + 3 * 8)

    def keys(self) -> list[tuple[int, int]]:
        """Every graph's key (piece, size), largest size first, as CudaGraphs orders its own."""
        return [(i, size) for size in reversed(self.token_sizes) for i in range(self.num_pieces)]

    def holds(self, num_tokens: int) -> bool:
        return bool(self.graphs) and num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        return next(s for s in self.token_sizes if s >= num_tokens)

    @torch.inference_mode()
    def step(self, key: tuple[int, int]) -> None:
        """What graph `key` captures: piece i of the forward over the buffers' first `size`
        rows."""
        i, size = key
        model, (k_cache, v_cache) = self.model, self.kv_caches
        residual = self.residual[:size]
        if i == 0:
            model.embed(self.input_ids[:size], out=residual)
            x = None
        else:
            x, _ = model.layer_out(i - 1, self.attn_out[:size], residual)
        if i == len(model.layers):
            self.hidden[:size].copy_(model.end(x, residual))
            return
        model.layer_in(i, x, residual, self.positions[:size], self.slot_mapping[:size],
                       k_cache[i], v_cache[i], qkv_out=self.qkv[:size])

    @torch.inference_mode()
    def capture(self, pool) -> float:
        """Runs every piece eagerly (kernels compiled, workspaces at their final size; the
        buffers' slots are -1, so nothing reaches the cache), then captures them into `pool`,
        shared with the full-step graphs: replays never overlap. Returns seconds taken."""
        start = time.perf_counter()
        keys = self.keys()
        for key in keys:
            self.step(key)
        torch.cuda.synchronize(self.input_ids.device)
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool):
                self.step(key)
            self.graphs[key] = graph
        torch.cuda.synchronize(self.input_ids.device)
        seconds = time.perf_counter() - start
        log.info("captured %d piecewise graphs (%d pieces at %s tokens) in %.2fs",
                 len(self.graphs), self.num_pieces, self.token_sizes, seconds)
        return seconds

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
                ) -> torch.Tensor:
        """LlamaModel.forward's hidden states [T, hidden] for a step of T <= max_tokens tokens
        (holds(T)): the pieces replayed at T's padded size, each layer's attention eagerly over
        the step's own T rows. A view of the buffer, valid until the next step."""
        num_tokens = input_ids.shape[0]
        size = self.padded_size(num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)  # pad rows write no cache slot
        cfg, (k_cache, v_cache) = self.model.config, self.kv_caches
        q = self.qkv[:num_tokens, :self._q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        attn_out = self.attn_out[:num_tokens]
        for i in range(len(self.model.layers)):
            self.graphs[(i, size)].replay()
            self.model.attend(i, q, md, k_cache[i], v_cache[i], out=attn_out)
        self.graphs[(len(self.model.layers), size)].replay()
        return self.hidden[:num_tokens]
