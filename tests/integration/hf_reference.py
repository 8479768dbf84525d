"""Greedy reference outputs from transformers `generate` on the same weights the executor loads."""
from __future__ import annotations

import functools

import torch
from transformers import GenerationConfig

from executor_svc.model_loader import load_hf_model


@functools.lru_cache(maxsize=4)
def hf_model(source: str, seed: int = 0, device: str = "cpu"):
    """Float32 transformers model; random preset weights are drawn on `device`, as the executor
    on that device draws them."""
    return load_hf_model(source, seed=seed, dtype=torch.float32, device=device)


def hf_greedy(source: str, prompt_ids: list[int], max_new_tokens: int, seed: int = 0,
              stop_at_eos: bool = False, device: str = "cpu") -> list[int]:
    """transformers' greedy continuation; without stop_at_eos it runs the full max_new_tokens."""
    model = hf_model(source, seed, device)
    eos = model.config.eos_token_id if stop_at_eos else None
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=device),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long,
                                                       device=device),
                             generation_config=config)
    return out[0, len(prompt_ids):].tolist()
