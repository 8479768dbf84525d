"""Sampler: greedy, temperature, top-k, top-p, min-p, and the logprob of the chosen token, on the
logits' device with no host sync (the caller makes the one transfer of the results).
Random draws are seeded per (seq seed, position) through a counter-based hash, so a recomputed
sequence samples the same tokens, whatever its batch, on CPU and GPU alike. Imports torch only.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import to_device
from executor_svc.step import SamplingOptions

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seq seed, position of the token being sampled); stable
    across processes (no Python hash randomisation)."""
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
    [n, vocab]. Integer ops wrap identically on CPU and CUDA."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=row_seeds.device)
    z = row_seeds.unsqueeze(1) + index.unsqueeze(0) * _GOLDEN  # [n, vocab]
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))  # top 24 bits


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the logits' device, built before the forward pass so that
    their host-to-device copies never wait for it."""

    num_rows: int
    all_greedy: bool
    any_greedy: bool
    greedy: torch.Tensor | None  # [n] bool
    temperature: torch.Tensor | None  # [n, 1] float32 (1 on greedy rows)
    top_k: torch.Tensor | None  # [n, 1] int64 (vocab when off)
    top_p: torch.Tensor | None  # [n, 1] float32
    min_p: torch.Tensor | None  # [n, 1] float32
    row_seeds: torch.Tensor | None  # [n] int64, position_seed(seed, position)

    @classmethod
    def build(cls, options: list[SamplingOptions], positions: list[int], vocab_size: int,
              device: torch.device) -> "SamplingTensors":
        greedy = [o.temperature <= 0.0 for o in options]
        if all(greedy):
            return cls(len(options), True, True, None, None, None, None, None, None)
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
                   ints[0].unsqueeze(1), floats[1].unsqueeze(1), floats[2].unsqueeze(1), ints[1])


class Sampler:
    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, options: list[SamplingOptions], positions: list[int]
    ) -> tuple[list[int], list[float]]:
        """logits: [n, vocab]; positions[i]: index the sampled token will take in seq i.
        Returns token ids and their logprobs under the unmodified model distribution."""
        params = SamplingTensors.build(options, positions, logits.shape[1], logits.device)
        token_ids, logprobs = self.sample(logits, params)
        return to_host(token_ids, logprobs)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: SamplingTensors
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [n] int64 and logprobs [n] float32, on the logits' device; no host sync."""
        logits = logits.float()
        token_ids = logits.argmax(dim=-1) if params.any_greedy else None
        if not params.all_greedy:
            probs = filtered_probs(logits, params)
            race = probs / -torch.log(uniform_noise(params.row_seeds, logits.shape[1]))
            drawn = race.argmax(dim=-1)  # exponential race: argmax p / E, E ~ Exp(1)
            token_ids = drawn if token_ids is None else torch.where(params.greedy, token_ids, drawn)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return token_ids, logprobs


def to_host(token_ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """The sampled ids and logprobs on the host, waiting for them (a host sync)."""
    both = torch.stack([token_ids.double(), logprobs.double()]).cpu()  # ids < 2^53: exact
    return from_host(both)


def copy_to_host(token_ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Queues the one device-to-host transfer of a step and returns its destination without
    waiting: [2, n] float64 (ids < 2^53: exact), pinned on CUDA; read it with from_host once the
    stream has passed the copy."""
    both = torch.stack([token_ids.double(), logprobs.double()])  # [2, n]
    if both.device.type != "cuda":
        return both
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
    return host.copy_(both, non_blocking=True)


def from_host(both: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and logprobs from a [2, n] host tensor of copy_to_host or to_host."""
    ids, logprobs = both.tolist()
    return [int(t) for t in ids], logprobs


def filtered_probs(logits: torch.Tensor, params: SamplingTensors | list[SamplingOptions]
                   ) -> torch.Tensor:
    """Temperature, then top-k and top-p on the sorted logits, then min-p: probs [n, vocab]."""
    if not isinstance(params, SamplingTensors):
        params = SamplingTensors.build(params, [0] * len(params), logits.shape[1], logits.device)
        if params.all_greedy:
            raise ValueError("filtered_probs needs temperature > 0")
    scaled = logits.float() / params.temperature  # [n, vocab]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [n, vocab]
    rank = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    drop = rank >= params.top_k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (keeps at least one).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= params.top_p
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocab order
    probs = scaled.masked_fill(mask, float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
