"""Sampler: greedy, temperature, top-k, top-p, min-p, and the logprob of the chosen token.
Random draws are seeded per (seq seed, position), so a recomputed sequence samples the same tokens.
"""
from __future__ import annotations

import hashlib

import torch

from executor_svc.step import SamplingOptions


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seq seed, position of the token being sampled); stable
    across processes (no Python hash randomisation)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Sampler:
    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, options: list[SamplingOptions], positions: list[int]
    ) -> tuple[list[int], list[float]]:
        """logits: [n, vocab] float32; positions[i]: index the sampled token will take in seq i.
        Returns token ids and their logprobs under the unmodified model distribution."""
        logits = logits.float()
        token_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy = torch.tensor([o.temperature <= 0.0 for o in options], device=logits.device)
        if greedy.any():
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        if not greedy.all():
            rows = (~greedy).nonzero().squeeze(1).tolist()
            probs = filtered_probs(logits[rows], [options[r] for r in rows])
            token_ids[rows] = _draw(probs, [options[r] for r in rows], [positions[r] for r in rows])
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return token_ids.tolist(), logprobs.tolist()


def filtered_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """Temperature, then top-k and top-p on the sorted logits, then min-p: probs [n, vocab]."""
    device = logits.device
    temperature = torch.tensor([o.temperature for o in options], device=device).unsqueeze(1)
    top_k = torch.tensor([o.top_k if o.top_k > 0 else logits.shape[1] for o in options], device=device)
    top_p = torch.tensor([o.top_p for o in options], device=device).unsqueeze(1)
    min_p = torch.tensor([o.min_p for o in options], device=device).unsqueeze(1)
    scaled = logits / temperature  # [n, vocab]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [n, vocab]
    rank = torch.arange(scaled.shape[1], device=device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (keeps at least one).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocab order
    probs = scaled.masked_fill(mask, float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _draw(probs: torch.Tensor, options: list[SamplingOptions], positions: list[int]) -> torch.Tensor:
    """One token per row by the exponential-race trick (argmax p / E, E ~ Exp(1)), with a
    generator per row seeded from (seed, position)."""
    chosen = []
    for row, opt, pos in zip(probs, options, positions):
        gen = torch.Generator(device=probs.device).manual_seed(position_seed(opt.seed, pos))
        race = torch.empty_like(row).exponential_(generator=gen)  # [vocab]
        chosen.append((row / race).argmax())
    return torch.stack(chosen)
