"""Factories for executor tests: HF reference models, runners on small caches, and a tiny plan
driver that plays the scheduler's part (block allocation from a shuffled free list)."""
from __future__ import annotations

import functools
import random

import torch
from transformers import GenerationConfig

from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import build_hf_model, model_from_hf
from executor_svc.model_runner import ModelRunner
from executor_svc.step import CachedSeq, ExecutorInfo, NewSeq, SamplingOptions, Step


@functools.lru_cache(maxsize=None)
def hf_model(preset: str):
    return build_hf_model(preset, seed=0)


def make_runner(hf, block_size: int = 4, num_gpu_blocks: int = 64, num_cpu_blocks: int = 32,
                max_model_len: int = 512) -> ModelRunner:
    backend = get_backend("cpu")
    config = ModelConfig.from_hf_config(hf.config)
    model = model_from_hf(hf, config, backend)
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                        num_gpu_blocks, num_cpu_blocks, torch.float32, backend)
    info = ExecutorInfo("test", "fp", "float32", block_size, num_gpu_blocks, num_cpu_blocks,
                        max_model_len, config.vocab_size, "", "cpu")
    return ModelRunner(model, backend, cache, info)


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    gen = GenerationConfig(max_new_tokens=num_new, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = hf.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt):].tolist()


def random_prompt(rng: random.Random, length: int, vocab: int = 49152) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


class PlanDriver:
    """Plays the scheduler: tracks tokens, block tables and counters; builds Steps."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.info.block_size
        self.free = list(range(runner.info.num_gpu_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order block tables
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.step_id = 0

    def blocks_needed(self, seq_id: int, num_tokens: int) -> list[int]:
        have = len(self.tables.get(seq_id, []))
        need = -(-num_tokens // self.block_size) - have
        new, self.free = self.free[:max(need, 0)], self.free[max(need, 0):]
        self.tables.setdefault(seq_id, []).extend(new)
        return new

    def new_seq(self, seq_id: int, tokens: list[int], num_scheduled: int | None = None,
                sampling: SamplingOptions = SamplingOptions(), num_computed: int = 0) -> NewSeq:
        self.tokens[seq_id] = list(tokens)
        n = len(tokens) - num_computed if num_scheduled is None else num_scheduled
        self.blocks_needed(seq_id, num_computed + n)
        self.computed[seq_id] = num_computed + n
        return NewSeq(seq_id, list(tokens), list(self.tables[seq_id]), num_computed, n, sampling)

    def cached_seq(self, seq_id: int, num_scheduled: int | None = None) -> CachedSeq:
        computed = self.computed[seq_id]
        n = len(self.tokens[seq_id]) - computed if num_scheduled is None else num_scheduled
        new_blocks = self.blocks_needed(seq_id, computed + n)
        self.computed[seq_id] = computed + n
        return CachedSeq(seq_id, n, computed, new_blocks)

    def run(self, **fields) -> dict[int, int]:
        """Execute one step; append and return the sampled tokens {seq_id: token_id}."""
        self.step_id += 1
        out = self.runner.execute(Step(self.step_id, **fields))
        sampled = {s.seq_id: s.token_id for s in out.sampled}
        for seq_id, token_id in sampled.items():
            self.tokens[seq_id].append(token_id)
        return sampled
