"""Sampler: logit bias, penalties, then greedy or temperature, top-k, top-p, min-p, and logprobs,
all on the logits' device with no host sync. Imports torch only.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import to_device
from executor_svc.step import SamplingOptions
from executor_svc.token_counts import TokenCounts

_MASK64 = (1 << 64) - 1
# Rows filtered or penalised at once: the sort's and the penalties' [rows, vocab] temporaries
# (values, int64 order, probs, their running sums, masks) for 1,024 rows of a 128k vocabulary
# are several GiB, which the memory profile keeps from the KV cache.
FILTER_ROWS = 256


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seq seed, position of the token being sampled); stable
    across processes (no Python hash randomisation). Seeding per position through a
    counter-based hash makes a recomputed seq sample the same tokens, whatever its batch, on CPU
    and GPU alike."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in
                         (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform_noise(row_seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """splitmix64 outputs 1..vocab of the stream seeded by each row's seed, as float32 in (0, 1):
    [n, vocab]. Integer ops wrap identically on CPU and CUDA. In place on two [n, vocab] int64
    tensors (1 GiB each at 1,024 rows of a 128k vocabulary): the sampling's peak is what the
    memory profile reserves for the decode graphs."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=row_seeds.device)
    z = row_seeds.unsqueeze(1) + index.unsqueeze(0) * _GOLDEN  # [n, vocab]
    t = torch.empty_like(z)  # [n, vocab]
    for shift, mix in ((30, _MIX1), (27, _MIX2), (31, None)):
        _shr_into(z, shift, t)
        z ^= t
        if mix is not None:
            z *= mix  # wraps as z * mix does
    _shr_into(z, 40, t)  # top 24 bits
    del z  # before the float32 copy: the peak stays at two [n, vocab] int64 tensors
    noise = t.float()  # [n, vocab]
    noise += 0.5
    noise *= 1.0 / (1 << 24)
    return noise


def gumbel_noise(row_seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-log(E) with E = -log(uniform_noise), E ~ Exp(1): [n, vocab] float32, in place on the
    noise. E is 0 where the noise rounds to 1.0 in float32 (1 token in 2^24); clamped to the
    smallest normal float, that token gets a finite score that all but certainly wins, as it
    would win the race p / E."""
    noise = uniform_noise(row_seeds, vocab_size)
    return noise.log_().neg_().clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_()


def race_argmax(scores: torch.Tensor, row_seeds: torch.Tensor, fused: bool | None = None
                ) -> torch.Tensor:
    """argmax over each row of scores [n, vocab] float32 + gumbel_noise(row_seeds): [n] int64.
    On CUDA (fused None) the one-pass kernel (pagedserve_kernels.ops.gumbel_argmax, these ops
    bit for bit) writes no [n, vocab] tensor; else the torch ops, in place on scores."""
    if scores.is_cuda if fused is None else fused:
        from pagedserve_kernels import ops  # CuPy: imported on the GPU only

        return ops.gumbel_argmax(scores, row_seeds)
    scores += gumbel_noise(row_seeds, scores.shape[1])
    return scores.argmax(dim=-1)


def _shr_into(x: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """out = _shr(x, n) without a temporary."""
    torch.bitwise_right_shift(x, n, out=out)
    out &= (1 << (64 - n)) - 1


@dataclass(frozen=True)
class Penalties:
    """The repetition, presence and frequency penalties of the rows that use one."""

    index: torch.Tensor  # [m] int64: their rows in the batch
    prompt_mask: torch.Tensor  # [m, vocab] bool
    output_counts: torch.Tensor  # [m, vocab] int32
    count_rows: torch.Tensor  # [m] int64: their rows of TokenCounts (where sampled ids count)
    repetition: torch.Tensor  # [m, 1] float32
    presence: torch.Tensor  # [m, 1] float32
    frequency: torch.Tensor  # [m, 1] float32


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the logits' device, built before the forward pass so that
    their host-to-device copies never wait for it. Penalties, logit bias and top logprobs are
    None / 0 unless some row asks for them."""

    num_rows: int
    all_greedy: bool
    any_greedy: bool
    greedy: torch.Tensor | None  # [n] bool
    temperature: torch.Tensor | None  # [n, 1] float32 (1 on greedy rows)
    top_k: torch.Tensor | None  # [n, 1] int64 (vocab when off)
    top_p: torch.Tensor | None  # [n, 1] float32
    min_p: torch.Tensor | None  # [n, 1] float32
    row_seeds: torch.Tensor | None  # [n] int64, position_seed(seed, position)
    # (rows [b] int64, token ids [b] int64, biases [b] float32): one entry per (row, token)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    num_top_logprobs: int = 0  # the most any row asked for
    filters: bool = True  # some row uses top-k, top-p or min-p (False: no sort in sampling)

    @classmethod
    def for_greedy(cls, num_rows: int) -> "SamplingTensors":
        """Every row greedy, none using a penalty, a logit bias or logprobs."""
        return cls(num_rows, True, True, None, None, None, None, None, None)

    @classmethod
    def build(cls, options: list[SamplingOptions], positions: list[int], vocab_size: int,
              device: torch.device, counts: TokenCounts | None = None,
              count_rows: list[int | None] | None = None, any_controls: bool = True
              ) -> "SamplingTensors":
        """count_rows[i]: row i's row of `counts` (None if it uses no penalty). any_controls=False
        promises that no row uses a penalty, a logit bias or logprobs: the common batch then
        skips the per-row check, the larger part of this build."""
        controls = (_controls(options, device, counts, count_rows) if any_controls
                    else (None, None, 0))
        greedy = [o.temperature <= 0.0 for o in options]
        if all(greedy):
            return cls(len(options), True, True, None, None, None, None, None, None, *controls)
        floats = torch.tensor([
            [1.0 if g else o.temperature for o, g in zip(options, greedy)],
            [o.top_p for o in options],
            [o.min_p for o in options],
            [float(g) for g in greedy],
        ], dtype=torch.float32)  # [4, n]
        ints = torch.tensor([
            [o.top_k if o.top_k > 0 else vocab_size for o in options],
            [position_seed(o.seed, p) for o, p in zip(options, positions)],
        ], dtype=torch.int64)  # [2, n]
        floats, ints = to_device(floats, device), to_device(ints, device)
        return cls(len(options), False, any(greedy), floats[3] > 0.5, floats[0].unsqueeze(1),
                   ints[0].unsqueeze(1), floats[1].unsqueeze(1), floats[2].unsqueeze(1), ints[1],
                   *controls, filters=any(o.uses_filters for o in options))


def _controls(options: list[SamplingOptions], device: torch.device, counts: TokenCounts | None,
              count_rows: list[int | None] | None) -> tuple:
    """(logit_bias, penalties, num_top_logprobs) of SamplingTensors; one pass over the rows
    when none asks for any."""
    rows = [i for i, o in enumerate(options) if o.has_controls]
    if not rows:
        return None, None, 0
    bias = [(i, t, b) for i in rows for t, b in options[i].logit_bias]
    logit_bias = None
    if bias:
        ids = to_device(torch.tensor([[i, t] for i, t, _ in bias], dtype=torch.int64), device)
        values = to_device(torch.tensor([b for _, _, b in bias], dtype=torch.float32), device)
        logit_bias = ids[:, 0], ids[:, 1], values
    penalised = [i for i in rows if options[i].uses_penalties]
    penalties = None
    if penalised:
        if counts is None or count_rows is None:
            raise ValueError("penalties need the seqs' TokenCounts rows")
        penalties = _penalties([options[i] for i in penalised], penalised,
                               [count_rows[i] for i in penalised], counts, device)
    top = max((options[i].logprobs or 0 for i in rows), default=0)
    return logit_bias, penalties, top


def _penalties(options: list[SamplingOptions], index: list[int], count_rows: list[int],
               counts: TokenCounts, device: torch.device) -> Penalties:
    ints = to_device(torch.tensor([index, count_rows], dtype=torch.int64), device)  # [2, m]
    floats = to_device(torch.tensor([
        [o.repetition_penalty for o in options],
        [o.presence_penalty for o in options],
        [o.frequency_penalty for o in options],
    ], dtype=torch.float32), device).unsqueeze(2)  # [3, m, 1]
    prompt_mask, output_counts = counts.gather(ints[1])
    return Penalties(ints[0], prompt_mask, output_counts, ints[1], *floats)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """In place on logits [n, vocab] float32: transformers' repetition penalty (a seen token's
    logit divided by it when positive, multiplied when not: the same float ops), then OpenAI's
    frequency and presence penalties on the generated tokens, as vLLM applies them. FILTER_ROWS
    penalised rows at a time (each row on its own, so the same values): their [rows, vocab]
    temporaries for every row at once would be the sampler's largest allocation."""
    for start in range(0, p.index.shape[0], FILTER_ROWS):
        part = slice(start, start + FILTER_ROWS)
        index, counts = p.index[part], p.output_counts[part]
        rows = logits[index]  # [rows, vocab]
        generated = counts > 0
        repetition = torch.where(p.prompt_mask[part] | generated, p.repetition[part], 1.0)
        rows = torch.where(rows < 0, rows * repetition, rows / repetition)
        rows = rows - p.frequency[part] * counts - p.presence[part] * generated
        logits.index_copy_(0, index, rows)


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                   values: torch.Tensor) -> None:
    """In place on contiguous logits [n, vocab]: logits[rows[i], ids[i]] += values[i]. One
    index_add_ into the flat logits (a plain kernel, safe inside a CUDA graph); entries
    (0, 0, 0.0) pad a graph's fixed-size buffer and change nothing (x + 0.0 == x)."""
    logits.view(-1).index_add_(0, rows * logits.shape[1] + ids, values)


def controlled_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [n, vocab] float32 with the logit bias, then the penalties applied (a new tensor
    when there are any: the model's own output stays unmodified, for logprobs)."""
    if params.logit_bias is None and params.penalties is None:
        return logits
    logits = logits.clone()
    if params.logit_bias is not None:
        add_logit_bias(logits, *params.logit_bias)
    if params.penalties is not None:
        apply_penalties(logits, params.penalties)
    return logits


class Sampler:
    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, options: list[SamplingOptions], positions: list[int],
        counts: TokenCounts | None = None, count_rows: list[int | None] | None = None,
    ) -> tuple[list[int], list[float]]:
        """logits: [n, vocab]; positions[i]: index the sampled token will take in seq i.
        Returns token ids and their logprobs under the unmodified model distribution."""
        params = SamplingTensors.build(options, positions, logits.shape[1], logits.device,
                                       counts, count_rows)
        token_ids, logprobs = self.sample(logits, params)
        return to_host(token_ids, logprobs)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: SamplingTensors
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [n] int64 and logprobs [n] float32, on the logits' device; no host sync.
        The logprobs are the raw model's (vLLM's default logprobs_mode, "raw_logprobs"): a
        log-softmax of the logits before logit bias, penalties, temperature and filters."""
        raw = logits.float()
        logits = controlled_logits(raw, params)
        token_ids = logits.argmax(dim=-1) if params.any_greedy else None
        if not params.all_greedy:
            # Gumbel-max: argmax of the filtered scaled logits plus -log(E), E ~ Exp(1), is the
            # exponential race argmax p / E without the softmax; dropped tokens stay -inf.
            # the controls' copy (not the model's logits, kept for logprobs) filtered in place
            drawn = race_argmax(filtered_logits(logits, params, in_place=logits is not raw),
                                params.row_seeds)
            token_ids = drawn if token_ids is None else torch.where(params.greedy, token_ids, drawn)
        logprobs = torch.log_softmax(raw, dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return token_ids, logprobs

    @torch.inference_mode()
    def top_logprobs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely tokens of each row under the raw model distribution, most likely
        first: ids [n, k] int64 and logprobs [n, k] float32; no host sync."""
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return ids, values


def to_host(token_ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """The sampled ids and logprobs on the host, waiting for them (a host sync)."""
    both = torch.stack([token_ids.double(), logprobs.double()]).cpu()  # ids < 2^53: exact
    return from_host(both)


def copy_to_host(token_ids: torch.Tensor, logprobs: torch.Tensor,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Queues the one device-to-host transfer of a step and returns its destination without
    waiting: [2 + 2k, n] float64 (ids < 2^53: exact): ids, logprobs, then the k top ids and k
    top logprobs of each row when `top` (ids, logprobs [n, k]) is given; pinned on CUDA. Read
    it with from_host and top_from_host once the stream has passed the copy."""
    both = torch.stack([token_ids.double(), logprobs.double()])  # [2, n]
    if top is not None:
        both = torch.cat([both, top[0].double().T, top[1].double().T])  # [2 + 2k, n]
    if both.device.type != "cuda":
        return both
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
    return host.copy_(both, non_blocking=True)


def from_host(both: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and logprobs from a host tensor of copy_to_host or to_host."""
    ids, logprobs = both[:2].tolist()
    return [int(t) for t in ids], logprobs


def top_from_host(both: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's top ids and logprobs from a host tensor of copy_to_host (empty lists if it
    carries none)."""
    k = (both.shape[0] - 2) // 2
    rows = both[2:].T.tolist()  # [n, 2k]
    return [[int(t) for t in r[:k]] for r in rows], [r[k:] for r in rows]


def filtered_probs(logits: torch.Tensor, params: SamplingTensors | list[SamplingOptions]
                   ) -> torch.Tensor:
    """The distribution a row samples from: the softmax of filtered_logits, probs [n, vocab]."""
    if not isinstance(params, SamplingTensors):
        params = SamplingTensors.build(params, [0] * len(params), logits.shape[1], logits.device)
        if params.all_greedy:
            raise ValueError("filtered_probs needs temperature > 0")
    return filtered_logits(logits, params).softmax(dim=-1)


def filtered_logits(logits: torch.Tensor, params: SamplingTensors,
                    in_place: bool = False) -> torch.Tensor:
    """The logits divided by the temperature, -inf on the tokens top-k, then top-p, then min-p
    drop: a new [n, vocab] float32 tensor (in_place: logits itself, float32, which the caller
    no longer needs). A batch without filters skips the sort; a batch with them is filtered
    FILTER_ROWS rows at a time (each row on its own, so the same values)."""
    scaled = (logits.div_(params.temperature) if in_place
              else logits.float() / params.temperature)  # [n, vocab]
    if not params.filters:
        return scaled
    for start in range(0, scaled.shape[0], FILTER_ROWS):
        rows = slice(start, start + FILTER_ROWS)
        _drop_filtered(scaled[rows], params.top_k[rows], params.top_p[rows], params.min_p[rows])
    return scaled


def _drop_filtered(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> None:
    """-inf into scaled [rows, vocab] (a view, in place) where top-k, top-p or min-p drop."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [rows, vocab]
    rank = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    drop = rank >= top_k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (keeps at least one).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p
    # min-p: below that fraction of the most likely token's probability (a ratio no
    # renormalisation after top-k / top-p changes).
    drop |= (sorted_logits - sorted_logits[:, :1]).exp() < min_p
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocab order
    scaled.masked_fill_(mask, float("-inf"))
