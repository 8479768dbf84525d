"""Greedy reference outputs from transformers `generate` on the same weights the executor loads."""
from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import GenerationConfig

from executor_svc.model_loader import load_hf_model

# One model per (source, seed, device) per test process, however it is asked for; generate runs
# one at a time (a reference computed in the background meets the test's own calls here).
_lock = threading.RLock()
_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-reference")


def hf_model(source: str, seed: int = 0, device: str = "cpu"):
    """Float32 transformers model; random preset weights are drawn on `device`, as the executor
    on that device draws them."""
    with _lock:
        return _load(source, seed, device)


# Enough for the default model to outlive the tiny presets loaded between its two users.
@functools.lru_cache(maxsize=16)
def _load(source: str, seed: int, device: str):
    return load_hf_model(source, seed=seed, dtype=torch.float32, device=device)


def hf_greedy(source: str, prompt_ids: list[int], max_new_tokens: int, seed: int = 0,
              stop_at_eos: bool = False, device: str = "cpu") -> list[int]:
    """transformers' greedy continuation; without stop_at_eos it runs the full max_new_tokens."""
    return list(_greedy(source, tuple(prompt_ids), max_new_tokens, seed, stop_at_eos, device))


# Once per arguments: scenarios that differ in flags send the same prompts (the same seeds).
@functools.lru_cache(maxsize=None)
def _greedy(source: str, prompt_ids: tuple[int, ...], max_new_tokens: int, seed: int,
            stop_at_eos: bool, device: str) -> tuple[int, ...]:
    with _lock:
        model = hf_model(source, seed, device)
        eos = model.config.eos_token_id if stop_at_eos else None
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids], device=device),
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long,
                                                           device=device),
                                 generation_config=config)
        return tuple(out[0, len(prompt_ids):].tolist())


def hf_greedy_later(source: str, prompts: list[list[int]],
                    max_new_tokens: int | list[int]) -> Future:
    """hf_greedy of each prompt (max_new_tokens: one for all, or one per prompt), computed in a
    background thread while the test goes on: the services it waits for leave a core idle at
    times. The future's result is their list."""
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
    return _background.submit(lambda: [hf_greedy(source, p, n) for p, n in zip(prompts, counts)])
