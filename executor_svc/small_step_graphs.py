"""SmallStepGraphs: short steps with prompt tokens (a cached-prefix chat turn, a few admissions)
replayed from CUDA graphs at a ladder of token counts, so they pay no eager launch of every
layer. Imports torch only; attention is reached through the model's backend.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from executor_svc.attention_metadata import AttentionMetadata
from executor_svc.device_tokens import DeviceTokens
from executor_svc.host_staging import HostStaging

log = logging.getLogger(__name__)

# vLLM captures its piecewise graphs up to 512 tokens by default; above that a step's matrix
# products take longer than launching it eagerly, so the launch hides behind its GPU time.
TOKEN_SIZES = (16, 32, 64, 128, 256, 512)
MAX_SEQS = 32


class SmallStepGraphs:
    """Captured forwards (embedding to the float32 logits of each sequence's last token) of
    `model` over `kv_caches` for steps of at most max(token_sizes) tokens and `max_seqs` seqs.

    A step is padded up to the nearest captured size: pad tokens write no slot (-1) and belong to
    no seq, pad seqs have no query tokens, so attention gives them no work. Every seq, one-token
    ones included, goes through the backend's prefill attention, because a graph's launch grid is
    fixed by its size. Only for models the attention kernels cover: the torch prefill twin reads
    its metadata on the host. Off CUDA, `run` calls the same forward eagerly on the same static
    buffers, so tests check the packing and padding on the CPU."""

    def __init__(self, model, kv_caches, max_blocks_per_seq: int,
                 token_sizes: tuple[int, ...] = TOKEN_SIZES, max_seqs: int = MAX_SEQS) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.token_sizes = tuple(sorted(token_sizes))
        self.max_tokens = self.token_sizes[-1]
        self.max_seqs = max_seqs
        self.width = max_blocks_per_seq  # block-table columns every graph was captured with
        self.device = kv_caches[0].device
        t, s, device = self.max_tokens, max_seqs, self.device
        # Static inputs (pad tokens: id 0, position 0, no slot; pad seqs: no query tokens)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)  # [t]
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=device)  # [s + 1]
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)  # [s]
        self.last_rows = torch.zeros(s, dtype=torch.int64, device=device)  # [s]
        self.block_tables = torch.zeros(s, self.width, dtype=torch.int32,
                                        device=device)  # [s, width]
        # Staged inputs, laid out as _offsets says, copied with one transfer.
        self._offsets = _layout(t, s)
        self.staging = HostStaging(self._offsets["tables"] + s * self.width, device)
        self._logits_out = torch.empty(s, model.config.vocab_size, dtype=torch.float32,
                                       device=device)  # [s, vocab], outside the graphs' pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._keepalive: list[torch.Tensor] = []

    def _forward(self, num_tokens: int) -> torch.Tensor:
        max_seqlen_k = self.width * self.kv_caches[0].shape[3]
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], block_tables=self.block_tables,
            cu_seqlens_q=self.cu_seqlens_q, seq_lens=self.seq_lens, max_seqlen_q=num_tokens,
            max_seqlen_k=max_seqlen_k, is_decode_only=False,
        )
        hidden = self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                    metadata, self.kv_caches)  # [num_tokens, hidden]
        return self.model.compute_logits(hidden[self.last_rows],
                                          out=self._logits_out)  # [max_seqs, vocab]

    @torch.inference_mode()
    def capture(self) -> float:
        """Run every size eagerly on the (all-padding) static inputs, so kernels are compiled
        and scratch workspaces sized, then capture largest first into one memory pool. Returns
        seconds taken; captures nothing off CUDA."""
        start = time.perf_counter()
        if self.device.type != "cuda":
            return 0.0
        for size in self.token_sizes:
            self._forward(size)
        torch.cuda.synchronize(self.device)
        self._keepalive = self.model.backend.graph_workspaces()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.token_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        log.info("captured small-step graphs for %s tokens (up to %d seqs) in %.2fs",
                 self.token_sizes, self.max_seqs, seconds)
        return seconds

    def can_run(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        return (num_tokens <= self.max_tokens and num_seqs <= self.max_seqs
                and max_blocks <= self.width
                and (bool(self.graphs) or self.device.type != "cuda"))

    def padded_size(self, num_tokens: int) -> int:
        return next(size for size in self.token_sizes if size >= num_tokens)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
            last_rows: np.ndarray, device_tokens: DeviceTokens | None = None) -> torch.Tensor:
        """One step: input_ids, positions, slots [num_tokens]; cu_seqlens_q [num_seqs + 1];
        seq_lens [num_seqs]; block_tables [num_seqs, width] (row i starting with seq i's table);
        last_rows [num_sampled]: the packed rows whose logits are wanted; input rows named by
        `device_tokens` take their id from the device. Returns the logits [num_sampled, vocab]
        float32, a view valid until the next replay."""
        num_tokens, num_seqs, num_sampled = len(input_ids), len(seq_lens), len(last_rows)
        size = self.padded_size(num_tokens)
        width = block_tables.shape[1]
        h, o = self.staging.take(), self._offsets
        self._pack(h, input_ids, positions, slots, cu_seqlens_q, seq_lens, last_rows,
                   device_tokens)
        used = o["tables"] + num_seqs * width
        h[o["tables"]:used] = block_tables.reshape(-1)  # columns past a table's end: never read
        self._spread(self.staging.send(0, used), size, num_seqs, width, device_tokens)
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self._logits_out
        else:  # no CUDA: the same forward, eagerly, on the same buffers
            with torch.inference_mode():
                logits = self._forward(size)
        return logits[:num_sampled]

    def _pack(self, h: np.ndarray, input_ids, positions, slots, cu_seqlens_q, seq_lens,
              last_rows, device_tokens: DeviceTokens | None) -> None:
        """Writes the step's host inputs, padded to the largest size, into pinned buffer h."""
        o, n, s = self._offsets, len(input_ids), len(seq_lens)
        t = self.max_tokens
        h[o["ids"]:o["ids"] + n], h[o["ids"] + n:o["ids"] + t] = input_ids, 0
        h[o["positions"]:o["positions"] + n] = positions
        h[o["positions"] + n:o["positions"] + t] = 0
        h[o["slots"]:o["slots"] + n], h[o["slots"] + n:o["slots"] + t] = slots, -1
        cu = o["cu"]
        h[cu:cu + s + 1], h[cu + s + 1:cu + self.max_seqs + 1] = cu_seqlens_q, cu_seqlens_q[-1]
        h[o["seq_lens"]:o["seq_lens"] + s] = seq_lens
        h[o["seq_lens"] + s:o["seq_lens"] + self.max_seqs] = 0
        m = len(last_rows)
        h[o["last"]:o["last"] + m], h[o["last"] + m:o["last"] + self.max_seqs] = last_rows, 0
        if device_tokens is not None:
            d = len(device_tokens.src_rows)
            h[o["src"]:o["src"] + d] = device_tokens.src_rows
            h[o["dst"]:o["dst"] + d] = device_tokens.dst_rows

    def _spread(self, staged: torch.Tensor, size: int, num_seqs: int, width: int,
                device_tokens: DeviceTokens | None) -> None:
        """The staged inputs into the graphs' static buffers (one device copy each)."""
        o, s = self._offsets, self.max_seqs
        self.input_ids[:size].copy_(staged[o["ids"]:o["ids"] + size])
        if device_tokens is not None:
            d = len(device_tokens.src_rows)
            device_tokens.scatter_into(self.input_ids, (staged[o["src"]:o["src"] + d],
                                                        staged[o["dst"]:o["dst"] + d]))
        self.positions[:size].copy_(staged[o["positions"]:o["positions"] + size])
        self.slot_mapping[:size].copy_(staged[o["slots"]:o["slots"] + size])
        self.cu_seqlens_q.copy_(staged[o["cu"]:o["cu"] + s + 1])
        self.seq_lens.copy_(staged[o["seq_lens"]:o["seq_lens"] + s])
        self.last_rows.copy_(staged[o["last"]:o["last"] + s])
        self.block_tables[:num_seqs, :width].copy_(
            staged[o["tables"]:o["tables"] + num_seqs * width].view(num_seqs, width))


def _layout(max_tokens: int, max_seqs: int) -> dict[str, int]:
    """Offsets of the pinned buffer's rows: five of max_tokens (ids, positions, slots, device
    tokens' source and destination rows), cu_seqlens_q, seq_lens, last rows, block tables."""
    t, s = max_tokens, max_seqs
    names = (("ids", t), ("positions", t), ("slots", t), ("src", t), ("dst", t),
             ("cu", s + 1), ("seq_lens", s), ("last", s))
    offsets, at = {}, 0
    for name, length in names:
        offsets[name], at = at, at + length
    offsets["tables"] = at
    return offsets
