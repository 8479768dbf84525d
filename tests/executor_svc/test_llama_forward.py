"""Our LlamaModel over the paged cache against transformers' logits on the same weights, and
bit for bit against the forward it had before RMSNorm, RoPE and SiLU-and-mul became backend ops."""
import random

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import model_from_hf
from executor_svc.models.llama import LlamaModel
from tests.executor_svc.helpers import hf_model, random_prompt
from tests.kernels.test_ops_reference import unfused_rms_norm, unfused_rope

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


def _unfused_forward(model, input_ids, positions, md, kv_caches):
    """The oracle: LlamaModel.forward as it was before the backend's elementwise ops (one rounded
    `h + out` per residual add, norms and RoPE by the formulas of transformers)."""
    cfg, backend, eps = model.config, model.backend, model.config.rms_norm_eps
    num_tokens = input_ids.shape[0]
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h = model.embed_tokens[input_ids]
    cos = model.rope_cos[positions].to(h.dtype)
    sin = model.rope_sin[positions].to(h.dtype)
    for i, layer in enumerate(model.layers):
        qkv = F.linear(unfused_rms_norm(h, layer.input_norm, eps), layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = unfused_rope(q.view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
        k = unfused_rope(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        backend.reshape_and_cache(k, v, kv_caches[0][i], kv_caches[1][i], md.slot_mapping)
        out = backend.paged_prefill_attention(q, kv_caches[0][i], kv_caches[1][i], md.block_tables,
                                              md.cu_seqlens_q, md.seq_lens, model.scale)
        h = h + F.linear(out.reshape(num_tokens, q_size), layer.o_proj)
        gate, up = F.linear(unfused_rms_norm(h, layer.post_attention_norm, eps),
                            layer.gate_up_proj).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, layer.down_proj)
    return unfused_rms_norm(h, model.norm, eps)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_bit_identical_to_the_unfused_formulas(preset, dtype):
    hf = hf_model(preset)
    config = ModelConfig.from_hf_config(hf.config)
    backend = get_backend("cpu")
    model = LlamaModel(config, {k: v.detach().to(dtype) for k, v in hf.state_dict().items()}, backend)
    caches = [CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                          16, 1, dtype, backend).kv_caches for _ in range(2)]
    rng = random.Random(4)
    prompts = [random_prompt(rng, 13), random_prompt(rng, 6)]
    tables = [list(range(8)), list(range(8, 16))]
    steps = [([0, 0], [13, 6]), ([13, 6], [1, 1])]  # prefill of both, then one decode step each
    for computed, scheduled in steps:
        prompts = [p + [rng.randrange(3, 49152)] for p in prompts] if computed[0] else prompts
        ids = torch.tensor([t for p, c, n in zip(prompts, computed, scheduled) for t in p[c:c + n]])
        positions, md = build_attention_metadata(tables, computed, scheduled, BLOCK_SIZE,
                                                 torch.device("cpu"))
        hidden = model.forward(ids, positions, md, caches[0])
        with torch.inference_mode():
            expect = _unfused_forward(model, ids, positions, md, caches[1])
        assert torch.equal(hidden, expect)


def test_mixed_batch_of_decodes_chunks_and_a_one_token_prompt():
    """Several decodes (the decode kernel), then prefill chunks and a new one-token prompt."""
    hf, model, cache = _setup("tiny")
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (7, 12, 5, 10, 1)]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2, 40 + i] for i in range(5)]
    _forward(model, cache, prompts[:4], tables[:4], [0, 0, 0, 0], [6, 11, 5, 4])
    prompts[2].append(rng.randrange(3, 49152))  # seq 2 decodes; 0 and 1 finish their prompts
    logits = _forward(model, cache, prompts, tables, [6, 11, 5, 4, 0], [1, 1, 1, 6, 1])
    for row, seq in enumerate((0, 1, 2)):
        torch.testing.assert_close(logits[row], _hf_logits(hf, prompts[seq])[-1], atol=ATOL,
                                   rtol=RTOL)
    torch.testing.assert_close(logits[3:9], _hf_logits(hf, prompts[3])[4:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[9], _hf_logits(hf, prompts[4])[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("seed", range(5))
def test_metadata_matches_a_per_token_reference(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    scheduled = sorted((rng.choice([1, 1, 1, rng.randint(1, 9)]) for _ in range(n)),
                       key=lambda q: q != 1)
    computed = [rng.randint(0, 30) for _ in range(n)]
    tables = [rng.sample(range(200), -(-(c + q) // BLOCK_SIZE) + rng.randint(0, 2))
              for c, q in zip(computed, scheduled)]
    positions, md = build_attention_metadata(tables, computed, scheduled, BLOCK_SIZE,
                                             torch.device("cpu"))
    want_pos = [p for c, q in zip(computed, scheduled) for p in range(c, c + q)]
    want_slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for t, c, q in zip(tables, computed, scheduled) for p in range(c, c + q)]
    assert positions.tolist() == want_pos and md.slot_mapping.tolist() == want_slots
    for i, t in enumerate(tables):
        assert md.block_tables[i, :len(t)].tolist() == t
    assert md.seq_lens.tolist() == [c + q for c, q in zip(computed, scheduled)]
    # The runner's form: rows of one array, stale ids past each table's end.
    width = max(map(len, tables)) + 3
    padded = np.array([t + [rng.randrange(200) for _ in range(width - len(t))] for t in tables],
                      dtype=np.int32)  # [n, width]
    positions2, md2 = build_attention_metadata(padded, computed, scheduled, BLOCK_SIZE,
                                               torch.device("cpu"))
    assert positions2.tolist() == want_pos and md2.slot_mapping.tolist() == want_slots
    assert md2.seq_lens.tolist() == md.seq_lens.tolist()
    decodes = next((i for i, q in enumerate(scheduled) if q != 1), n)
    assert md.is_decode_only == (decodes == n)
    if md.prefill is None:
        assert md.num_decodes == 0 and (decodes in (0, n))
    else:
        assert md.num_decodes == decodes
        rest = scheduled[decodes:]
        assert md.prefill.cu_seqlens_q.tolist() == [sum(rest[:i]) for i in range(len(rest) + 1)]
        assert md.prefill.seq_lens.tolist() == md.seq_lens[decodes:].tolist()
