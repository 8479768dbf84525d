"""DecodeGraphs: decode steps replayed from CUDA graphs (forward plus one GraphSampler variant)
captured at start for a ladder of batch sizes, inputs staged in one pinned copy. Imports torch
only; attention is reached through the model's backend.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from executor_svc.attention_metadata import AttentionMetadata
from executor_svc.device_tokens import DeviceTokens
from executor_svc.graph_sampler import (
    GREEDY, MAX_CONTROLLED_BATCH, MAX_LOGIT_BIAS, GraphSampler, StepSampling,
)
from executor_svc.host_staging import HostStaging
from executor_svc.token_counts import TokenCounts

log = logging.getLogger(__name__)

# Steps of 16 to 128, then 32, then 64 (padding wastes at most ~1/8 of a large batch); up to
# 1,024 sequences, vLLM's max_num_seqs. Every size writes its logits into one shared buffer, so
# the ladder's length costs capture time, not memory.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
               448, 512, 576, 640, 704, 768, 832, 896, 960, 1024)
_ROWS = 6  # rows of max_batch_size after the sampling parameters: see run()


class DecodeGraphs:
    """Captured decode steps (embedding to float32 logits, then sampling) of `model` over
    `kv_caches`. sample_in_graphs=False captures the greedy variant only and leaves every
    step's sampling to the eager Sampler (its logits are still the graph's)."""

    def __init__(self, model, kv_caches, max_blocks_per_seq: int,
                 batch_sizes: tuple[int, ...] = BATCH_SIZES, sample_in_graphs: bool = True,
                 max_controlled_batch: int = MAX_CONTROLLED_BATCH,
                 max_logit_bias: int = MAX_LOGIT_BIAS) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        self.width = max_blocks_per_seq  # block-table columns every graph was captured with
        device = kv_caches[0].device
        n = self.max_batch_size
        # Static inputs; padded rows write no slot (-1) and attend to one token of whatever block
        # their stale table row names (always a valid id: only block ids are ever written).
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [n]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [n]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32,
                                        device=device)  # [n, width]
        self.sampler = GraphSampler(n, model.config.vocab_size, device,
                                    max_controlled_batch, max_logit_bias)
        self.sample_in_graphs = sample_in_graphs
        # Staged inputs: the sampler's parameter region, _ROWS rows of n, then the block tables.
        # The graphs read the sampling parameters straight from the device twin.
        self._base = self.sampler.num_slots  # where the input rows start
        self.staging = HostStaging(self._base + _ROWS * n + n * self.width, device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # (variant, bs) ->
        # The graphs' logits, outside their pool and shared by all sizes: replays are ordered on
        # one stream, and a step's eager sampling reads its logits before the next replay writes.
        self._logits_out = torch.empty(n, model.config.vocab_size, dtype=torch.float32,
                                       device=device)  # [n, vocab]
        self._keepalive: list[torch.Tensor] = []

    def variants(self, bs: int) -> tuple[str, ...]:
        """The variants captured for batch size bs."""
        return self.sampler.variants(bs) if self.sample_in_graphs else (GREEDY,)

    def prepare(self, counts: TokenCounts) -> None:
        """Binds the sampler to the static buffers and to `counts` (reserving its rows), with
        neutral parameters in every row. capture() calls it; on CPU, tests call it and run
        step() eagerly in place of replays."""
        self.sampler.bind(self.staging.twin[:self._base], counts)
        self.sampler.pack_neutral(self.staging.take()[:self._base])
        self.staging.send(0, self._base)

    def step(self, variant: str, bs: int) -> None:
        """What graph (variant, bs) captures: the forward of the first bs static rows into the
        logits buffer, then the variant's sampling into the sampler's outputs."""
        self.sampler.sample_into(self._forward(bs), variant)

    def _forward(self, bs: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], seq_lens=self.seq_lens[:bs],
            max_seqlen_q=1, max_seqlen_k=self.width * self.kv_caches[0].shape[3],
            is_decode_only=True,
        )
        hidden = self.model.forward(self.input_ids[:bs], self.positions[:bs], metadata,
                                    self.kv_caches)
        return self.model.compute_logits(hidden, out=self._logits_out[:bs])  # [bs, vocab]

    @torch.inference_mode()
    def capture(self, counts: TokenCounts) -> float:
        """prepare(counts), then run every (variant, size) eagerly (kernels compiled, scratch
        workspaces at their final size), then capture largest first into one shared memory
        pool, so the pool holds the peak of one graph (the sampled variant at the largest size,
        which memory_profile.graph_reserve_bytes reserves). Everything a graph reads is a static
        tensor of this object, of the sampler, of `counts` or of the model and cache. Returns
        seconds taken."""
        start = time.perf_counter()
        self.prepare(counts)
        for bs in self.batch_sizes:
            for variant in self.variants(bs):
                self.step(variant, bs)
        torch.cuda.synchronize()
        self._keepalive = self.model.backend.graph_workspaces()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):
            for variant in self.variants(bs):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.step(variant, bs)
                self.graphs[(variant, bs)] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        log.info("captured %d decode graphs for batch sizes %s in %.2fs", len(self.graphs),
                 self.batch_sizes, seconds)
        return seconds

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.max_batch_size and max_blocks <= self.width

    def padded_size(self, num_seqs: int) -> int:
        return next(bs for bs in self.batch_sizes if bs >= num_seqs)

    def run(self, input_ids: list[int], positions: np.ndarray, slots: np.ndarray,
            block_tables: np.ndarray, device_tokens: DeviceTokens | None = None,
            sampling: StepSampling | None = None) -> tuple[torch.Tensor, bool]:
        """One decode step of len(input_ids) sequences (seq_len = position + 1); block_tables
        [num_seqs, width] int, row i starting with seq i's table; rows named by `device_tokens`
        take their input id from the device instead; `sampling`: what the rows sample (None:
        sample nothing in the graph). Returns the logits view [num_seqs, vocab], valid until the
        next replay (later work on the stream may read it), and whether the graph sampled the
        step (then into self.sampler's outputs; else the caller samples the logits)."""
        num_seqs = len(input_ids)
        bs = self.padded_size(num_seqs)
        variant = None
        if sampling is not None and self.sample_in_graphs:
            variant = self.sampler.variant(sampling, bs)
        replayed = variant or GREEDY
        n, p, h = self.max_batch_size, self._base, self.staging.take()
        if variant is not None:
            self.sampler.pack(h[:p], bs, sampling, variant)
        self._pack_inputs(h[p:], bs, input_ids, positions, slots, block_tables, device_tokens)
        start, used = self.sampler.starts[replayed], p + _ROWS * n + num_seqs * block_tables.shape[1]
        staged = self.staging.send(start, used)
        self._spread_inputs(staged[p:], bs, num_seqs, block_tables.shape[1], device_tokens)
        self.graphs[(replayed, bs)].replay()
        return self._logits_out[:num_seqs], variant is not None

    def _pack_inputs(self, h: np.ndarray, bs: int, input_ids: list[int], positions: np.ndarray,
                     slots: np.ndarray, block_tables: np.ndarray,
                     device_tokens: DeviceTokens | None) -> None:
        """The input rows and block tables into the host buffer past the sampling region."""
        num_seqs, n = len(input_ids), self.max_batch_size
        h[0:num_seqs], h[num_seqs:bs] = input_ids, 0
        h[n:n + num_seqs], h[n + num_seqs:n + bs] = positions, 0
        h[2 * n:2 * n + num_seqs], h[2 * n + num_seqs:2 * n + bs] = slots, -1
        h[3 * n:3 * n + num_seqs] = positions
        h[3 * n:3 * n + num_seqs] += 1
        h[3 * n + num_seqs:3 * n + bs] = 1
        m = len(device_tokens.src_rows) if device_tokens is not None else 0
        if m:
            h[4 * n:4 * n + m], h[5 * n:5 * n + m] = device_tokens.src_rows, device_tokens.dst_rows
        # columns past a table's end are never read
        h[_ROWS * n:_ROWS * n + block_tables.size] = block_tables.reshape(-1)

    def _spread_inputs(self, staged: torch.Tensor, bs: int, num_seqs: int, width: int,
                       device_tokens: DeviceTokens | None) -> None:
        """The staged input rows into the graphs' static buffers, on the device."""
        n = self.max_batch_size
        m = len(device_tokens.src_rows) if device_tokens is not None else 0
        self.input_ids[:bs].copy_(staged[0:bs])
        if m:
            device_tokens.scatter_into(self.input_ids, (staged[4 * n:4 * n + m],
                                                        staged[5 * n:5 * n + m]))
        self.positions[:bs].copy_(staged[n:n + bs])
        self.slot_mapping[:bs].copy_(staged[2 * n:2 * n + bs])
        self.seq_lens[:bs].copy_(staged[3 * n:3 * n + bs])
        self.block_tables[:num_seqs, :width].copy_(
            staged[_ROWS * n:_ROWS * n + num_seqs * width].view(num_seqs, width))
