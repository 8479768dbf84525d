"""Our LlamaModel over the paged cache against transformers' logits on the same weights."""
import random

import pytest
import torch

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import model_from_hf
from tests.executor_svc.helpers import hf_model, random_prompt

PRESETS = ["tiny", "tiny-qwen2", "tiny-llama3"]
BLOCK_SIZE = 4
ATOL, RTOL = 1e-4, 1e-4


def _setup(preset):
    hf = hf_model(preset)
    config = ModelConfig.from_hf_config(hf.config)
    backend = get_backend("cpu")
    model = model_from_hf(hf, config, backend)
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                        64, 4, torch.float32, backend)
    return hf, model, cache


def _hf_logits(hf, tokens):
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def _forward(model, cache, tokens, tables, computed, scheduled):
    """Run one packed step; tokens[i] is seq i's full token list. Returns logits of every row."""
    ids = torch.tensor([t for toks, c, n in zip(tokens, computed, scheduled) for t in toks[c:c + n]])
    positions, md = build_attention_metadata(tables, computed, scheduled, BLOCK_SIZE, torch.device("cpu"))
    hidden = model.forward(ids, positions, md, cache.kv_caches)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_then_decode_through_shuffled_blocks(preset):
    hf, model, cache = _setup(preset)
    rng = random.Random(1)
    blocks = list(range(64))
    rng.shuffle(blocks)
    prompts = [random_prompt(rng, 13), random_prompt(rng, 6)]
    tables = [blocks[:8], blocks[8:16]]
    logits = _forward(model, cache, prompts, tables, [0, 0], [13, 6])
    torch.testing.assert_close(logits[:13], _hf_logits(hf, prompts[0]), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[13:], _hf_logits(hf, prompts[1]), atol=ATOL, rtol=RTOL)
    for _ in range(4):  # decode steps: one query per seq, extending both through the cache
        for p in prompts:
            p.append(rng.randrange(3, 49152))
        logits = _forward(model, cache, prompts, tables, [len(p) - 1 for p in prompts], [1, 1])
        for row, p in enumerate(prompts):
            torch.testing.assert_close(logits[row], _hf_logits(hf, p)[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_in_three_steps(preset):
    hf, model, cache = _setup(preset)
    rng = random.Random(2)
    prompt = random_prompt(rng, 17)
    table = rng.sample(range(64), 5)
    expected = _hf_logits(hf, prompt)
    start = 0
    for chunk in (6, 5, 6):
        logits = _forward(model, cache, [prompt], [table], [start], [chunk])
        torch.testing.assert_close(logits, expected[start:start + chunk], atol=ATOL, rtol=RTOL)
        start += chunk


def test_mixed_batch_prefill_chunk_and_decode():
    """A decode row and a prefill chunk packed into one step (the prefill attention path)."""
    hf, model, cache = _setup("tiny")
    rng = random.Random(3)
    a, b = random_prompt(rng, 9), random_prompt(rng, 11)
    tables = [[5, 1, 9], [2, 7, 30]]
    _forward(model, cache, [a, b], tables, [0, 0], [8, 4])
    logits = _forward(model, cache, [a, b], tables, [8, 4], [1, 7])
    torch.testing.assert_close(logits[0], _hf_logits(hf, a)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[1:], _hf_logits(hf, b)[4:], atol=ATOL, rtol=RTOL)
