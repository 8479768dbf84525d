"""Every supported family from a random-weight folder written by transformers' own config class
and save_pretrained, loaded by our loader: greedy output token-identical in float32 to
transformers' generate over 64+ tokens (chunked prefill, mixed decode+prefill steps, shuffled
pages, prompts longer than any sliding window), and the load-time refusals."""
import dataclasses
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.cache_engine import CacheEngine
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import (ModelSourceError, check_model_source, load_model,
                                       model_from_hf)

BLOCK_SIZE = 4
NUM_NEW = 64
VOCAB = 512
WINDOW = 16  # below every prompt: the windowed layers drop keys in prefill and decode
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3)


def _qwen3():
    from transformers import Qwen3Config

    # head_dim 32, not hidden / heads = 16; windows on the layers from max_window_layers on
    return Qwen3Config(**_SHAPE, head_dim=32, rope_theta=1e6, tie_word_embeddings=False,
                       use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _qwen3_full():
    from transformers import Qwen3Config

    return Qwen3Config(**_SHAPE, head_dim=32, tie_word_embeddings=True, attention_bias=True)


def _phi3_short():
    """LongRoPE whose original context (64) is past every sequence here: the short factors."""
    from transformers import Phi3Config

    return Phi3Config(**_SHAPE, original_max_position_embeddings=128, rope_scaling=_longrope())


def _phi3_long():
    """Prompts past the original context (32): transformers and we both take the long factors."""
    from transformers import Phi3Config

    return Phi3Config(**_SHAPE, original_max_position_embeddings=32, rope_scaling=_longrope())


def _longrope():
    rng = random.Random(5)
    half = 64 // 4 // 2
    return dict(type="longrope", short_factor=[1 + rng.random() for _ in range(half)],
                long_factor=[2 + 4 * rng.random() for _ in range(half)])


def _glm():
    from transformers import GlmConfig

    return GlmConfig(**_SHAPE, head_dim=32, partial_rotary_factor=0.5, attention_bias=True)


def _glm4():
    from transformers import Glm4Config

    return Glm4Config(**_SHAPE, head_dim=32, partial_rotary_factor=0.5, attention_bias=True)


def _gemma2():
    from transformers import Gemma2Config

    # Untied: with a tied head the next token follows the current one's embedding, whatever
    # attention does, and the output could not tell soft-capping or windows from none.
    return Gemma2Config(**_SHAPE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                        tie_word_embeddings=False)


def _gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_SHAPE, head_dim=32, query_pre_attn_scalar=24,
                            sliding_window=WINDOW, sliding_window_pattern=2,
                            rope_theta=1e6, rope_local_base_freq=100.0,
                            rope_scaling=dict(rope_type="linear", factor=4.0),
                            tie_word_embeddings=False)


FAMILIES = {"qwen3": _qwen3, "qwen3-full": _qwen3_full, "phi3-short": _phi3_short,
            "phi3-long": _phi3_long, "glm": _glm, "glm4": _glm4, "gemma2": _gemma2,
            "gemma3": _gemma3}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a model folder written by save_pretrained (made once, on first use)."""
    made = {}

    def folder(name):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            write_family_folder(name, made[name])
        return str(made[name])
    return folder


def write_family_folder(name, path) -> None:
    """FAMILIES[name]'s random-weight folder at `path`, written by save_pretrained (the
    integration tests serve the same folders)."""
    family_model(FAMILIES[name]()).save_pretrained(path)


def family_model(config):
    """transformers' float32 model of `config`, random weights drawn under seed 0 (the GPU
    tests draw their bf16 shapes here too)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases start constant: a swapped pair would pass
        for param_name, param in hf.named_parameters():
            if "norm" in param_name or param_name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.2)
    return hf


def _hf_greedy(folder, prompt):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # else generate stops at the folder's EOS
    gen = GenerationConfig(max_new_tokens=NUM_NEW, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long),
                          generation_config=gen)
    return out[0, len(prompt):].tolist()


def _our_greedy(model, config, prompts, max_model_len):
    """Both prompts generated together, as the scheduler packs them: seq 0 prefills in chunks of
    17, seq 1 starts at step 2, so decode rows lead prefill chunks (the mixed path)."""
    model.set_max_model_len(max_model_len)
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                        128, 1, torch.float32, model.backend)
    free = list(range(128))
    random.Random(3).shuffle(free)
    tokens = [list(p) for p in prompts]
    tables = [free[:60], free[60:120]]
    computed, step = [0, 0], 0
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < NUM_NEW:
        step += 1
        active = [i for i in (0, 1) if (i == 0 or step >= 2)
                  and len(tokens[i]) - len(prompts[i]) < NUM_NEW]
        counts = {i: min(17, len(tokens[i]) - computed[i]) for i in active}
        order = sorted(active, key=lambda i: counts[i] != 1)  # one-token rows first
        ids = torch.tensor([t for i in order for t in tokens[i][computed[i]:computed[i] + counts[i]]])
        positions, md = build_attention_metadata([tables[i] for i in order],
                                                 [computed[i] for i in order],
                                                 [counts[i] for i in order], BLOCK_SIZE,
                                                 torch.device("cpu"))
        hidden = model.forward(ids, positions, md, cache.kv_caches)
        ends = torch.tensor([counts[i] for i in order]).cumsum(0) - 1
        logits = model.compute_logits(hidden[ends])
        for row, i in enumerate(order):
            computed[i] += counts[i]
            if computed[i] == len(tokens[i]):
                tokens[i].append(int(logits[row].argmax()))
    return [t[len(p):] for t, p in zip(tokens, prompts)]


def _prompts(family):
    rng = random.Random(7)
    lengths = (48, 23) if family != "phi3-long" else (40, 35)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_generate(folders, family):
    folder = folders(family)
    model, config, _, _ = load_model(folder, "float32")
    prompts = _prompts(family)
    max_model_len = config.max_position_embeddings
    if family == "phi3-short":  # vLLM's rule: the short factors when max_model_len fits them
        max_model_len = config.rope_scaling.original_max_position_embeddings
    ours = _our_greedy(model, config, prompts, max_model_len)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(folder, prompt)


# family -> ModelConfig fields that switch one of its quirks off; each must change the output,
# or the identity above would not show that quirk computed right.
QUIRKS_OFF = [
    ("qwen3", dict(qk_norm=False)), ("qwen3", dict(layer_windows=())),
    ("qwen3-full", dict(attention_bias=False)),
    ("phi3-long", dict(rope_scaling=None)),
    ("glm", dict(rope_interleaved=False)), ("glm", dict(rotary_dim=None)),
    ("glm4", dict(sandwich_norms=False)),
    ("gemma2", dict(attn_logit_softcapping=None)), ("gemma2", dict(layer_windows=())),
    ("gemma2", dict(embed_scale=None)),
    ("gemma2", dict(norm_plus_one=False)), ("gemma2", dict(query_pre_attn_scalar=None)),
    ("gemma2", dict(hidden_act="silu")),
    ("gemma3", dict(local_rope_theta=None)), ("gemma3", dict(qk_norm=False)),
    ("gemma3", dict(layer_windows=())), ("gemma3", dict(rope_scaling=None)),
]


@pytest.mark.parametrize("family, off", QUIRKS_OFF)
def test_each_quirk_changes_the_output(folders, family, off):
    folder = folders(family)
    model, config, _, _ = load_model(folder, "float32")
    prompts = _prompts(family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    without = model_from_hf(hf, dataclasses.replace(config, **off), model.backend)
    max_len = config.max_position_embeddings
    assert (_our_greedy(without, without.config, prompts, max_len)
            != _our_greedy(model, config, prompts, max_len))


def test_gemma2_logits_are_soft_capped_as_transformers(folders):
    """The final soft-cap keeps greedy's argmax: its logits are checked instead."""
    folder = folders("gemma2")
    model, config, _, _ = load_model(folder, "float32")
    prompt = _prompts("gemma2")[0]
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                        16, 1, torch.float32, model.backend)
    positions, md = build_attention_metadata([list(range(16))], [0], [len(prompt)], BLOCK_SIZE,
                                             torch.device("cpu"))
    logits = model.compute_logits(model.forward(torch.tensor(prompt), positions, md,
                                                cache.kv_caches))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert logits.abs().max() < 3.0 < model.backend.linear(
        model.forward(torch.tensor(prompt), positions, md, cache.kv_caches), model.lm_head
    ).abs().max()


def test_family_quirks_are_switched_on(folders):
    """The configs above exercise what each family is here for (a guard on the test itself)."""
    cfg = {name: ModelConfig.from_hf_config(FAMILIES[name]()) for name in FAMILIES}
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim == 32
    assert cfg["qwen3"].layer_windows == (None, WINDOW, WINDOW)
    assert cfg["phi3-long"].rope_scaling.original_max_position_embeddings == 32
    assert cfg["glm"].rotary_dim == 16 and cfg["glm"].rope_interleaved and cfg["glm"].attention_bias
    assert cfg["glm4"].sandwich_norms and not cfg["glm"].sandwich_norms
    g2, g3 = cfg["gemma2"], cfg["gemma3"]
    assert g2.attn_logit_softcapping == 5.0 and g2.final_logit_softcapping == 3.0
    assert g2.layer_windows == (WINDOW, None, WINDOW) and g2.hidden_act == "gelu_tanh"
    assert g2.norm_plus_one and g2.embed_scale == 8.0 and g2.attn_scale == 24**-0.5
    assert g3.layer_windows == (WINDOW, None, WINDOW) and g3.qk_norm
    assert g3.local_rope_theta == 100.0 and g3.rope_scaling.factor == 4.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cuda_backend_takes_every_family(family):
    """Windows, soft-capping, partial and interleaved rotary are the kernels' arguments:
    nothing about a family is refused at load."""
    from executor_svc.backends.cuda import CudaBackend

    CudaBackend.check_model(ModelConfig.from_hf_config(FAMILIES[family]()))


def test_an_unsupported_model_type_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelSourceError, match="unsupported model_type 'gpt2'; pagedserve serves "
                                               "llama, mistral, qwen2, qwen3, phi3, glm, glm4"):
        check_model_source(str(tmp_path))
