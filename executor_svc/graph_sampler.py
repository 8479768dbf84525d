"""GraphSampler: the sampling inside the decode CUDA graphs, from static parameter buffers into
static outputs, with the eager Sampler's ops. Imports torch and numpy only; on CPU it runs eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from executor_svc.sampler import Penalties, Sampler, SamplingTensors, position_seed
from executor_svc.step import SamplingOptions
from executor_svc.token_counts import TokenCounts

GREEDY, SAMPLED, CONTROLLED = "greedy", "sampled", "controlled"
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs maximum
MAX_CONTROLLED_BATCH = 256
# Logit-bias entries of one step (vLLM allows 300 a request): 24 bytes each in the copy.
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class StepSampling:
    """What a decode step samples, by row of the graph's batch."""

    rows: np.ndarray  # [m] int64: the batch rows that sample, ascending
    options: list[SamplingOptions] | None = None  # [m]; None: all greedy, none with controls
    positions: np.ndarray | None = None  # [m] int64: the position each sampled token takes
    count_rows: list[int | None] | None = None  # [m]: rows of TokenCounts (None: no penalty)

    @cached_property
    def num_top_logprobs(self) -> int:
        """The most top logprobs a row asks for."""
        return max((o.logprobs or 0 for o in self.options or ()), default=0)

    @cached_property
    def num_logit_bias(self) -> int:
        return sum(len(o.logit_bias) for o in self.options or ())

    @cached_property
    def uses_penalties(self) -> bool:
        return any(o.uses_penalties for o in self.options or ())


@dataclass(frozen=True)
class _Fields:
    """The named views of a parameter region (numpy on the host, torch on the device)."""

    bias_rows: object  # [b] int64 (padding: row 0, token 0, value 0.0)
    bias_ids: object  # [b] int64
    bias_values: object  # [b] float64
    count_row: object  # [n] int64: row of TokenCounts (the neutral row when none)
    penalised: object  # [n] int64: 1 where the sampled id is counted
    penalty_floats: object  # [4, n] float32: repetition, presence, frequency, (unused)
    top_k: object  # [n] int64 (vocab when off)
    seed: object  # [n] int64: position_seed(seed, position)
    sampled_floats: object  # [4, n] float32: temperature (1 on greedy rows), top_p, min_p, greedy

    @classmethod
    def of(cls, buf, n: int, b: int) -> "_Fields":
        numpy = isinstance(buf, np.ndarray)
        f32, f64 = (np.float32, np.float64) if numpy else (torch.float32, torch.float64)
        c, s = 3 * b, 3 * b + 4 * n
        return cls(buf[0:b], buf[b:2 * b], buf[2 * b:3 * b].view(f64),
                   buf[c:c + n], buf[c + n:c + 2 * n],
                   buf[c + 2 * n:c + 4 * n].view(f32).reshape(4, n),
                   buf[s:s + n], buf[s + n:s + 2 * n],
                   buf[s + 2 * n:s + 4 * n].view(f32).reshape(4, n))


def region_slots(max_batch: int, max_logit_bias: int) -> int:
    """int64 slots of a parameter region."""
    return 3 * max_logit_bias + 8 * max_batch


class GraphSampler:
    """Static sampling parameters and outputs for batches of up to max_batch rows.

    Three variants, each captured per batch size, so that a batch pays only for what it uses:
    - GREEDY (every row greedy, no controls): argmax + raw logprob.
    - SAMPLED (temperature and seeds, no filter): the eager sampler's sampled path without its
      sort, greedy rows picked by a mask.
    - CONTROLLED (any penalty, logit bias, top logprobs or top-k / top-p / min-p): penalties on
      every row (rows that use none get neutral parameters and TokenCounts' all-zero row: x /
      1.0, x * 1.0 and x - 0.0 are exact), logit bias, the sampled path with its filters, top
      logprobs, the sampled ids counted. Sizes up to max_controlled_batch only, so its
      [bs, vocab] intermediates stay small in the pool.
    A step that fits no variant replays the GREEDY graph and samples its logits eagerly.

    The host parameter region is ordered so a variant copies only what it reads: CONTROLLED
    from offset 0 (bias entries, penalty rows, then sampled rows), SAMPLED from its rows.
    """

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device,
                 max_controlled_batch: int = MAX_CONTROLLED_BATCH,
                 max_logit_bias: int = MAX_LOGIT_BIAS) -> None:
        n, b = max_batch, max_logit_bias
        self.max_batch, self.vocab_size, self.device = n, vocab_size, device
        self.max_controlled_batch = min(max_controlled_batch, n)
        self.max_logit_bias = b
        self.num_slots = region_slots(n, b)
        # Where a variant's copy starts in the region (it reads nothing before that).
        self.starts = {CONTROLLED: 0, SAMPLED: 3 * b + 4 * n, GREEDY: self.num_slots}
        self.top_k = min(MAX_TOP_LOGPROBS, vocab_size)
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.logprobs = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.top_ids = torch.zeros(n, self.top_k, dtype=torch.int64, device=device)  # [n, k]
        self.top_logprobs = torch.zeros(n, self.top_k, dtype=torch.float32,
                                        device=device)  # [n, k]
        self._rows = torch.arange(n, dtype=torch.int64, device=device)  # [n]: penalties' index
        self._fields: _Fields | None = None
        self.counts: TokenCounts | None = None
        self._counts_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sampler = Sampler()

    def variants(self, bs: int) -> tuple[str, ...]:
        """The variants captured for batch size bs."""
        return (GREEDY, SAMPLED) + ((CONTROLLED,) if bs <= self.max_controlled_batch else ())

    def bind(self, params: torch.Tensor, counts: TokenCounts) -> None:
        """Reads parameters from `params` (int64 [num_slots] on the device, the copy of the
        host region) and counts penalties in `counts`, whose rows are reserved now for
        max_batch seqs and a neutral row: the tensors a graph reads must not move."""
        self._fields = _Fields.of(params, self.max_batch, self.max_logit_bias)
        counts.reserve(self.max_batch)
        self.counts = counts
        self._counts_tensors = (counts.prompt_mask, counts.output_counts)

    # -- host side ---------------------------------------------------------------------------

    def variant(self, step: StepSampling, bs: int) -> str | None:
        """The variant that samples this step in a graph of size bs; None: sample eagerly."""
        options = step.options
        if options is None:
            return GREEDY
        if not any(o.uses_penalties or o.logit_bias or o.logprobs or o.uses_filters
                   for o in options):
            return GREEDY if all(o.temperature <= 0.0 for o in options) else SAMPLED
        fits = (bs <= self.max_controlled_batch and step.num_logit_bias <= self.max_logit_bias
                and step.num_top_logprobs <= self.top_k
                and (not step.uses_penalties or self._counts_in_place()))
        return CONTROLLED if fits else None

    def _counts_in_place(self) -> bool:
        """Whether TokenCounts still holds the tensors the graphs captured (it has not grown)."""
        return (self.counts is not None
                and self.counts.output_counts is self._counts_tensors[1]
                and self.counts.prompt_mask is self._counts_tensors[0])

    def pack(self, host: np.ndarray, bs: int, step: StepSampling, variant: str) -> None:
        """Writes the parameters `variant` reads for rows [0, bs) into the host region `host`
        (int64 [num_slots]); rows that do not sample are greedy and use no control."""
        if variant == GREEDY:
            return
        f = _Fields.of(host, self.max_batch, self.max_logit_bias)
        self._pack_sampled(f, bs, step)
        if variant == CONTROLLED:
            self._pack_controls(f, bs, step)

    def pack_neutral(self, host: np.ndarray) -> None:
        """Every row greedy without controls, in every field: what the warm-up runs on."""
        empty = StepSampling(np.zeros(0, dtype=np.int64), [], np.zeros(0, dtype=np.int64), [])
        f = _Fields.of(host, self.max_batch, self.max_logit_bias)
        self._pack_sampled(f, self.max_batch, empty)
        self._pack_controls(f, self.max_batch, empty)

    def _pack_sampled(self, f: _Fields, bs: int, step: StepSampling) -> None:
        """As SamplingTensors.build packs them; padding and non-sampling rows greedy."""
        floats = f.sampled_floats
        floats[:, :bs] = np.array([[1.0], [1.0], [0.0], [1.0]], dtype=np.float32)
        f.top_k[:bs], f.seed[:bs] = self.vocab_size, 0
        options, rows = step.options, step.rows
        if not options:
            return
        greedy = [o.temperature <= 0.0 for o in options]
        floats[:, rows] = np.array([
            [1.0 if g else o.temperature for o, g in zip(options, greedy)],
            [o.top_p for o in options],
            [o.min_p for o in options],
            [float(g) for g in greedy],
        ], dtype=np.float32)  # [4, m]
        f.top_k[rows] = [o.top_k if o.top_k > 0 else self.vocab_size for o in options]
        f.seed[rows] = [position_seed(o.seed, int(p)) for o, p in zip(options, step.positions)]

    def _pack_controls(self, f: _Fields, bs: int, step: StepSampling) -> None:
        """Penalty rows (neutral where unused) and the bias entries, padded with no-op ones."""
        f.count_row[:bs], f.penalised[:bs] = self.counts.neutral_row, 0
        f.penalty_floats[:, :bs] = np.array([[1.0], [0.0], [0.0], [0.0]], dtype=np.float32)
        f.bias_rows[:], f.bias_ids[:], f.bias_values[:] = 0, 0, 0.0
        options, rows = step.options or (), step.rows
        penalised = [i for i, o in enumerate(options) if o.uses_penalties]
        if penalised:
            at = rows[penalised]
            f.count_row[at] = [step.count_rows[i] for i in penalised]
            f.penalised[at] = 1
            f.penalty_floats[:3, at] = np.array([
                [options[i].repetition_penalty for i in penalised],
                [options[i].presence_penalty for i in penalised],
                [options[i].frequency_penalty for i in penalised],
            ], dtype=np.float32)  # [3, p]
        bias = [(int(rows[i]), t, v) for i, o in enumerate(options) for t, v in o.logit_bias]
        if bias:
            f.bias_rows[:len(bias)], f.bias_ids[:len(bias)], f.bias_values[:len(bias)] = zip(*bias)

    # -- device side: what a graph captures ---------------------------------------------------

    def tensors(self, variant: str, bs: int) -> SamplingTensors:
        """SamplingTensors for rows [0, bs) made of views of the static buffers (and, for
        CONTROLLED, the rows of TokenCounts gathered on the device); no host sync."""
        if variant == GREEDY:
            return SamplingTensors.for_greedy(bs)
        f = self._fields
        floats = f.sampled_floats[:, :bs]  # [4, bs]
        controls = (None, None, 0)
        if variant == CONTROLLED:
            count_rows = f.count_row[:bs]  # [bs]
            prompt_mask, output_counts = self.counts.gather(count_rows)  # [bs, vocab]
            pf = f.penalty_floats[:, :bs].unsqueeze(2)  # [4, bs, 1]
            penalties = Penalties(self._rows[:bs], prompt_mask, output_counts, count_rows,
                                  pf[0], pf[1], pf[2])
            bias = (f.bias_rows, f.bias_ids, f.bias_values.float())
            controls = (bias, penalties, self.top_k)
        return SamplingTensors(bs, False, True, floats[3] > 0.5, floats[0].unsqueeze(1),
                               f.top_k[:bs].unsqueeze(1), floats[1].unsqueeze(1),
                               floats[2].unsqueeze(1), f.seed[:bs], *controls,
                               filters=variant == CONTROLLED)

    @torch.inference_mode()
    def sample_into(self, logits: torch.Tensor, variant: str) -> None:
        """Samples logits [bs, vocab] float32 with the eager Sampler's ops into the static
        outputs (rows [0, bs)); CONTROLLED also takes the top logprobs and counts the sampled
        ids of penalised rows. Allocates only from the (graph's) caching allocator."""
        bs = logits.shape[0]
        params = self.tensors(variant, bs)
        token_ids, logprobs = self._sampler.sample(logits, params)
        self.token_ids[:bs].copy_(token_ids)
        self.logprobs[:bs].copy_(logprobs)
        if variant == CONTROLLED:
            top_ids, top_logprobs = self._sampler.top_logprobs(logits, self.top_k)
            self.top_ids[:bs].copy_(top_ids)
            self.top_logprobs[:bs].copy_(top_logprobs)
            f = self._fields
            self.counts.count(f.count_row[:bs], token_ids, f.penalised[:bs].to(torch.int32))

    def results(self, num_rows: int, index: torch.Tensor | None, num_top: int
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The sampled rows' token ids [m] (a new tensor: the next replay overwrites the
        outputs, and later steps may read them), logprobs [m] and, when num_top, their top ids
        and logprobs [m, num_top]: rows `index` of the first num_rows (all when None)."""
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[:num_rows] if index is None else t.index_select(0, index)

        token_ids = rows(self.token_ids)
        if index is None:
            token_ids = token_ids.clone()
        top = None
        if num_top:
            top = rows(self.top_ids)[:, :num_top], rows(self.top_logprobs)[:, :num_top]
        return token_ids, rows(self.logprobs), top
