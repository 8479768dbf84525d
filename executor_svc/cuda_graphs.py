"""CudaGraphs: steps replayed from CUDA graphs captured at start, on one set of static buffers
filled from one staged copy: decode steps (grammar-masked and sampled in the graph) by batch size,
short steps with prompt tokens by token count. Imports torch only; the model's backend runs ops.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention_metadata import AttentionMetadata, to_device
from executor_svc.device_tokens import DeviceTokens
from executor_svc.graph_sampler import (
    GREEDY, MAX_CONTROLLED_BATCH, MAX_LOGIT_BIAS, GraphSampler, StepSampling,
)
from executor_svc.host_staging import HostStaging
from executor_svc.piecewise_graphs import PiecewiseGraphs
from executor_svc.token_counts import TokenCounts
from pagedserve_kernels import graph_capture

log = logging.getLogger(__name__)

# Steps of 16 to 128, then 32, then 64 (padding wastes at most ~1/8 of a large batch); up to
# 1,024 sequences, vLLM's max_num_seqs. Every size writes its logits into one shared buffer, so
# the ladder's length costs capture time, not memory.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
               448, 512, 576, 640, 704, 768, 832, 896, 960, 1024)
# vLLM captures its piecewise graphs up to 512 tokens by default; above that a step's matrix
# products take longer than launching it eagerly, so the launch hides behind its GPU time.
TOKEN_SIZES = (16, 32, 64, 128, 256, 512)
MAX_SEQS = 32  # seqs of a small step
# Decode batches up to this size have masked variants (a grammar's bitmask applied to the logits
# before the sampling): vLLM's max_num_seqs default; each adds its variants' captures.
MAX_MASKED_BATCH = 256
_MASKED = "masked_"  # the prefix of a masked variant's name

DECODE = "decode"  # the ladder of decode steps: every seq computes one token
# The ladder of small steps, and its graphs' variant: the forward to the sampled rows' logits,
# which the eager Sampler samples.
SMALL_STEP = "small_step"


def masked(variant: str) -> str:
    """The decode variant that masks the logits with the step's GrammarMask, then samples them
    as `variant` does."""
    return _MASKED + variant


@dataclass(frozen=True)
class GrammarMask:
    """What the constrained rows of a decode step may sample."""

    rows: np.ndarray  # [m] int64: their rows of the batch (the graph's logits rows), distinct
    bitmask: np.ndarray  # [m, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 allows token t


@dataclass(frozen=True)
class GraphInputs:
    """A step's inputs on the host (int64) as a graph reads them."""

    input_ids: np.ndarray  # [num_tokens]; rows named by device_tokens take their id from it
    positions: np.ndarray  # [num_tokens]
    slots: np.ndarray  # [num_tokens]
    seq_lens: np.ndarray  # [num_seqs]
    block_tables: np.ndarray  # [num_seqs, width], row i starting with seq i's table
    # A small step's query offsets [num_seqs + 1] and the packed rows whose logits are wanted
    # [num_sampled]; None for a decode step (a token per seq, every seq's logits).
    cu_seqlens_q: np.ndarray | None = None
    last_rows: np.ndarray | None = None
    device_tokens: DeviceTokens | None = None

    @property
    def is_decode(self) -> bool:
        return self.cu_seqlens_q is None


class CudaGraphs:
    """Captured forwards of `model` over `kv_caches`, keyed (variant, size): a decode step of
    `size` seqs (embedding to float32 logits, then one GraphSampler variant, or for sizes up to
    max_masked_batch its masked(variant), which first applies a GrammarMask's bitmask, staged
    with the inputs, through the backend's apply_token_bitmask; with sample_in_graphs=False the
    greedy variant only, every step sampled eagerly from its logits), or (SMALL_STEP, size) a
    step of `size` tokens and `max_seqs` seqs with prompt tokens (embedding to the float32
    logits of each sampled seq's last token).

    A step is padded to the nearest size of its ladder. Pad tokens write no slot (-1); a decode
    step's pad seqs each own one pad token (seq_len 1, reading one key of whatever block their
    stale table row names: only block ids are ever written), a small step's own none (seq_len 0,
    no attention work). A small step sends every seq, one-token ones included, through the
    backend's prefill attention: a graph's launch grid is fixed by its size. Small steps need
    the attention kernels (the torch prefill twin reads its metadata on the host). Tests on the
    CPU replace `graphs` with eager calls of step()."""

    def __init__(self, model, kv_caches, max_blocks_per_seq: int,
                 batch_sizes: tuple[int, ...] = BATCH_SIZES,
                 token_sizes: tuple[int, ...] = TOKEN_SIZES, max_seqs: int = MAX_SEQS,
                 sample_in_graphs: bool = True,
                 max_controlled_batch: int = MAX_CONTROLLED_BATCH,
                 max_logit_bias: int = MAX_LOGIT_BIAS,
                 max_masked_batch: int = MAX_MASKED_BATCH,
                 piece_sizes: tuple[int, ...] = ()) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, kv_caches[0].device
        # Steps neither ladder holds, up to the largest of piece_sizes: captured in this pool
        self.piecewise = PiecewiseGraphs(model, kv_caches, piece_sizes) if piece_sizes else None
        self.batch_sizes, self.token_sizes = tuple(sorted(batch_sizes)), tuple(sorted(token_sizes))
        self.max_batch_size = self.batch_sizes[-1] if self.batch_sizes else 0
        self.max_tokens = self.token_sizes[-1] if self.token_sizes else 0
        self.max_seqs = max_seqs if self.token_sizes else 0
        self.width = max_blocks_per_seq  # block-table columns every graph was captured with
        self.sample_in_graphs = sample_in_graphs
        n = self.max_batch_size
        t, s = max(n, self.max_tokens), max(n, self.max_seqs)  # rows both ladders share
        self.sampler = GraphSampler(n, model.config.vocab_size, self.device,
                                    max_controlled_batch, max_logit_bias)
        self.max_masked_batch = min(max_masked_batch, n) if sample_in_graphs else 0
        self._make_static_inputs(t, s)
        self._make_mask_buffers(model.config.vocab_size)
        # Staged: the sampler's parameter region, which the decode graphs read straight from the
        # device twin, then the input rows laid out as _offsets says, then a masked step's mask
        # right after its block tables.
        self._base = self.sampler.num_slots
        self._offsets = _layout(t, s)
        m = self.max_masked_batch
        self.staging = HostStaging(self._base + self._offsets["tables"] + s * self.width
                                   + m * (1 + self._mask_slots), self.device)
        # The graphs' logits, outside their pool and shared by all graphs: replays are ordered
        # on one stream, and a step's eager sampling reads its logits before the next replay.
        self._logits_out = torch.empty(s, model.config.vocab_size, dtype=torch.float32,
                                       device=self.device)  # [s, vocab]
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._keepalive: list[torch.Tensor] = []

    def _make_static_inputs(self, t: int, s: int) -> None:
        """The buffers every graph reads, for t tokens and s seqs. Each row starts as a decode
        pad (token 0 at position 0, no slot, seq_len 1), valid input for both ladders."""
        device = self.device
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)  # [t]
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)  # [t]
        self.seq_lens = torch.ones(s, dtype=torch.int32, device=device)  # [s]
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=device)  # [s + 1]
        # A decode step's query offsets: one token a seq, never staged.
        self._one_token_cu = torch.arange(s + 1, dtype=torch.int32, device=device)  # [s + 1]
        self.last_rows = torch.zeros(s, dtype=torch.int64, device=device)  # [s]
        self.block_tables = torch.zeros(s, self.width, dtype=torch.int32,
                                        device=device)  # [s, width]

    def _make_mask_buffers(self, vocab_size: int) -> None:
        """The masked variants' bitmask rows and their logits rows, for max_masked_batch rows;
        rows padded to whole int64 slots, as they are staged."""
        words = -(-vocab_size // 32)
        self._mask_slots = -(-words // 2)  # int64 slots of a staged bitmask row
        m = self.max_masked_batch
        self._bitmask_slots = torch.full((m, self._mask_slots), -1, dtype=torch.int64,
                                         device=self.device)  # [m, slots]
        self.bitmask = self._bitmask_slots.view(torch.int32)[:, :words]  # [m, words] int32
        # The logits row each bitmask row masks; -1: none (the rows past a step's constrained)
        self.mask_indices = torch.full((m,), -1, dtype=torch.int64, device=self.device)  # [m]

    # -- what is captured ---------------------------------------------------------------------

    def variants(self, bs: int) -> tuple[str, ...]:
        """The variants captured for decode batch size bs."""
        if not self.sample_in_graphs:
            return (GREEDY,)
        plain = self.sampler.variants(bs)
        return plain + (tuple(map(masked, plain)) if bs <= self.max_masked_batch else ())

    def keys(self) -> list[tuple[str, int]]:
        """Every graph's key, largest first: the sampled decode variants at the largest batch
        hold the pool's peak, and each later capture reuses the blocks earlier ones freed."""
        decode = [(v, bs) for bs in reversed(self.batch_sizes) for v in self.variants(bs)]
        return decode + [(SMALL_STEP, size) for size in reversed(self.token_sizes)]

    def prepare(self, counts: TokenCounts | None) -> None:
        """Binds the sampler to the static buffers and to `counts` (reserving its rows), with
        neutral parameters in every row; nothing without a decode ladder (then counts may be
        None). capture() calls it; on CPU, tests call it and run step() in place of replays."""
        if not self.batch_sizes:
            return
        self.sampler.bind(self.staging.twin[:self._base], counts)
        self.sampler.pack_neutral(self.staging.take()[:self._base])
        self.staging.send(0, self._base)

    @torch.inference_mode()
    def step(self, key: tuple[str, int]) -> None:
        """What graph `key` captures: the forward of the static inputs' first rows into the
        logits buffer, then for a decode variant its sampling into the sampler's outputs."""
        variant, size = key
        if variant == SMALL_STEP:
            self._forward(size, self.max_seqs, decode=False)
            return
        logits = self._forward(size, size, decode=True)  # [size, vocab]
        if variant.startswith(_MASKED):
            self.model.backend.apply_token_bitmask(logits, self.bitmask[:size],
                                                   self.mask_indices[:size])
            variant = variant[len(_MASKED):]
        self.sampler.sample_into(logits, variant)

    def _forward(self, num_tokens: int, num_seqs: int, decode: bool) -> torch.Tensor:
        """Logits [num_seqs, vocab] float32: of every token (decode) or of last_rows."""
        cu_seqlens_q = self._one_token_cu if decode else self.cu_seqlens_q
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], block_tables=self.block_tables[:num_seqs],
            cu_seqlens_q=cu_seqlens_q[:num_seqs + 1], seq_lens=self.seq_lens[:num_seqs],
            max_seqlen_q=1 if decode else num_tokens,
            max_seqlen_k=self.width * self.kv_caches[0].shape[3], is_decode_only=decode,
        )
        hidden = self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                    metadata, self.kv_caches)  # [num_tokens, hidden]
        if not decode:
            hidden = hidden[self.last_rows[:num_seqs]]  # [num_seqs, hidden]
        return self.model.compute_logits(hidden, out=self._logits_out[:num_seqs])

    @torch.inference_mode()
    def capture(self, counts: TokenCounts | None) -> float:
        """prepare(counts), then run every graph's step eagerly (kernels compiled, scratch
        workspaces at their final size), then capture them in keys() order into one memory
        pool, which then holds the peak of one graph (memory_profile.graph_reserve_bytes
        reserves the decode sampling's). Everything a graph reads is a static tensor of this
        object, of the sampler, of `counts` or of the model and cache. Returns seconds taken."""
        start = time.perf_counter()
        self.prepare(counts)
        keys = self.keys()
        for key in keys:
            self.step(key)
        torch.cuda.synchronize(self.device)
        self._keepalive = self.model.backend.graph_workspaces()
        # what the captures add, against what the memory profile reserved for them
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool):
                self.step(key)
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        if self.piecewise is not None:
            self.piecewise.capture(pool)
        seconds = time.perf_counter() - start
        pool_gib = (torch.cuda.memory_reserved(self.device) - reserved) / 2**30
        log.info("captured %d graphs (decode batch sizes %s, masked up to %d seqs; small steps "
                 "of %s tokens, up to %d seqs) in %.2fs, their memory pool %.2f GiB",
                 len(self.graphs), self.batch_sizes, self.max_masked_batch, self.token_sizes,
                 self.max_seqs, seconds, pool_gib)
        return seconds

    # -- replay ---------------------------------------------------------------------------------

    def choose(self, num_tokens: int, num_seqs: int, max_blocks: int, decode: bool) -> str | None:
        """The ladder that replays a step: DECODE when `decode` (every seq computes one token)
        and a decode graph holds its seqs, else SMALL_STEP where a small-step graph holds its
        tokens and seqs; None: the step runs eagerly."""
        if not self.graphs or max_blocks > self.width:
            return None
        if decode and num_seqs <= self.max_batch_size:
            return DECODE
        if num_tokens <= self.max_tokens and num_seqs <= self.max_seqs:
            return SMALL_STEP
        return None

    def padded_size(self, size: int, decode: bool) -> int:
        """The ladder's size a step of `size` seqs (decode) or tokens (small) replays."""
        return next(s for s in (self.batch_sizes if decode else self.token_sizes) if s >= size)

    def masks_in_graph(self, sampling: StepSampling, num_seqs: int) -> bool:
        """Whether a decode step of num_seqs seqs that samples `sampling` replays a masked
        variant when run() is given its GrammarMask; else its graph returns the logits, which
        the caller masks and samples eagerly."""
        if num_seqs > self.max_masked_batch:
            return False
        size = self.padded_size(num_seqs, True)
        return size <= self.max_masked_batch and self.sampler.variant(sampling, size) is not None

    def run(self, inputs: GraphInputs, sampling: StepSampling | None = None,
            mask: GrammarMask | None = None, may_sample: bool = True
            ) -> tuple[torch.Tensor | None, tuple | None]:
        """One step replayed; `sampling`: what its rows sample (None: nothing in the graph);
        `mask`: what a decode step's constrained rows may sample, applied in the graph before
        its sampling (masks_in_graph must hold); may_sample=False: no sampling in the graph (a
        constrained step without its mask). Returns (the sampling rows' logits [m, vocab],
        None), a view valid until the next replay (later work on the stream may read it), or,
        when a decode graph sampled them, (None, GraphSampler.results: token ids, logprobs, top
        ones or None)."""
        decode = inputs.is_decode
        num_seqs = len(inputs.seq_lens)
        size = self.padded_size(num_seqs if decode else len(inputs.input_ids), decode)
        variant = None
        if decode and sampling is not None and self.sample_in_graphs and may_sample:
            variant = self.sampler.variant(sampling, size)
        if mask is not None and (variant is None or size > self.max_masked_batch):
            raise ValueError(f"no masked decode graph samples this step of {num_seqs} seqs")
        host, p = self.staging.take(), self._base
        if variant is not None:
            self.sampler.pack(host[:p], size, sampling, variant)
        seqs = size if decode else self.max_seqs
        end = p + self._pack(host[p:], inputs, size, seqs)
        mask_at = end - p
        if mask is not None:
            end = p + self._pack_mask(host[p:], mask_at, mask, size)
        staged = self.staging.send(self.sampler.starts[variant] if variant else p, end)
        self._spread(staged[p:], inputs, size, seqs)
        if mask is not None:
            self._spread_mask(staged[p:], mask_at, len(mask.rows), size)
            variant = masked(variant)
        self.graphs[(variant or GREEDY, size) if decode else (SMALL_STEP, size)].replay()
        if not decode:  # last_rows picked the sampling rows
            return self._logits_out[:len(inputs.last_rows)], None
        index = None  # the sampling rows among the seqs (None: all of them)
        if sampling is not None and len(sampling.rows) != num_seqs:
            index = to_device(torch.from_numpy(sampling.rows), self.device)
        if variant is not None:
            return None, self.sampler.results(num_seqs, index, sampling.num_top_logprobs)
        logits = self._logits_out[:num_seqs]  # [num_seqs, vocab]
        return (logits if index is None else logits[index]), None

    def _pack(self, h: np.ndarray, inputs: GraphInputs, num_tokens: int, num_seqs: int) -> int:
        """Writes the inputs, padded to num_tokens tokens and num_seqs seqs, into host rows h;
        returns where the rows used end."""
        o, decode = self._offsets, inputs.is_decode
        _put(h, o["ids"], inputs.input_ids, num_tokens, 0)
        _put(h, o["positions"], inputs.positions, num_tokens, 0)
        _put(h, o["slots"], inputs.slots, num_tokens, -1)
        _put(h, o["seq_lens"], inputs.seq_lens, num_seqs, 1 if decode else 0)
        if not decode:
            cu = inputs.cu_seqlens_q
            _put(h, o["cu"], cu, num_seqs + 1, cu[-1])
            _put(h, o["last"], inputs.last_rows, num_seqs, 0)
        if inputs.device_tokens is not None:
            d = inputs.device_tokens
            h[o["src"]:o["src"] + len(d.src_rows)] = d.src_rows
            h[o["dst"]:o["dst"] + len(d.dst_rows)] = d.dst_rows
        end = o["tables"] + inputs.block_tables.size
        h[o["tables"]:end] = inputs.block_tables.reshape(-1)  # columns past a table's end: unread
        return end

    def _spread(self, staged: torch.Tensor, inputs: GraphInputs, num_tokens: int,
                num_seqs: int) -> None:
        """The staged rows into the static buffers, on the device (a decode step's graphs read
        no query offsets or last rows)."""
        o = self._offsets
        self.input_ids[:num_tokens].copy_(staged[o["ids"]:o["ids"] + num_tokens])
        if inputs.device_tokens is not None:
            m = len(inputs.device_tokens.src_rows)
            inputs.device_tokens.scatter_into(self.input_ids, (staged[o["src"]:o["src"] + m],
                                                               staged[o["dst"]:o["dst"] + m]))
        self.positions[:num_tokens].copy_(staged[o["positions"]:o["positions"] + num_tokens])
        self.slot_mapping[:num_tokens].copy_(staged[o["slots"]:o["slots"] + num_tokens])
        self.seq_lens[:num_seqs].copy_(staged[o["seq_lens"]:o["seq_lens"] + num_seqs])
        if not inputs.is_decode:
            self.cu_seqlens_q[:num_seqs + 1].copy_(staged[o["cu"]:o["cu"] + num_seqs + 1])
            self.last_rows[:num_seqs].copy_(staged[o["last"]:o["last"] + num_seqs])
        rows, width = inputs.block_tables.shape
        self.block_tables[:rows, :width].copy_(
            staged[o["tables"]:o["tables"] + rows * width].view(rows, width))

    def _pack_mask(self, h: np.ndarray, at: int, mask: GrammarMask, size: int) -> int:
        """Writes the mask's logits rows, padded with -1 to `size` (the masked variant's bitmask
        rows), then its bitmask rows into host rows h from `at`; returns where they end."""
        m, words = len(mask.rows), self.bitmask.shape[1]
        if mask.bitmask.shape != (m, words) or m > size:
            raise ValueError(f"a mask of {m} rows of {words} words for a batch of {size}, got "
                             f"rows {mask.rows.shape} and bitmask {mask.bitmask.shape}")
        _put(h, at, mask.rows, size, -1)
        start, end = at + size, at + size + m * self._mask_slots
        h[start:end].view(np.int32).reshape(m, 2 * self._mask_slots)[:, :words] = mask.bitmask
        return end

    def _spread_mask(self, staged: torch.Tensor, at: int, num_masked: int, size: int) -> None:
        """The staged mask (from `at`, as _pack_mask wrote it) into the masked variants' buffers;
        bitmask rows past num_masked keep stale bits, which their -1 rows never apply."""
        self.mask_indices[:size].copy_(staged[at:at + size])
        start = at + size
        rows = staged[start:start + num_masked * self._mask_slots]
        self._bitmask_slots[:num_masked].copy_(rows.view(num_masked, self._mask_slots))


def _put(h: np.ndarray, at: int, values, padded: int, pad) -> None:
    """values into h[at:], then `pad` up to `padded` entries."""
    n = len(values)
    h[at:at + n], h[at + n:at + padded] = values, pad


def _layout(max_tokens: int, max_seqs: int) -> dict[str, int]:
    """Offsets of the staged input rows: five of max_tokens (ids, positions, slots, device
    tokens' source and destination rows), cu_seqlens_q, seq_lens, last rows, block tables."""
    t, s = max_tokens, max_seqs
    names = (("ids", t), ("positions", t), ("slots", t), ("src", t), ("dst", t),
             ("cu", s + 1), ("seq_lens", s), ("last", s))
    offsets, at = {}, 0
    for name, length in names:
        offsets[name], at = at, at + length
    offsets["tables"] = at
    return offsets
