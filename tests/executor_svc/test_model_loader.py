"""load_model for presets and local HF folders; tokenizer sources; dtypes; llama3 preset config."""
import logging
import random

import torch

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine
from executor_svc.model_config import ModelConfig, preset_hf_config
from executor_svc.config import ExecutorConfig
from executor_svc.fingerprint import model_fingerprint, source_identity
from executor_svc.model_loader import load_model, tokenizer_source
from executor_svc.step import SamplingOptions
from tests.executor_svc.helpers import PlanDriver, hf_model, make_runner, random_prompt


def test_local_hf_folder_loads_the_same_weights(tmp_path):
    hf = hf_model("tiny-qwen2")
    hf.save_pretrained(tmp_path)
    model, config, tokenizer, name = load_model(str(tmp_path), "float32")
    preset_model, preset_config, _, _ = load_model("preset:tiny-qwen2", "float32")
    assert config == preset_config and tokenizer == ""  # save_pretrained writes no tokenizer
    assert name == tmp_path.name
    assert torch.equal(model.layers[1].qkv_proj, preset_model.layers[1].qkv_proj)
    assert torch.equal(model.layers[0].qkv_bias, preset_model.layers[0].qkv_bias)
    assert (model_fingerprint(config, source_identity(str(tmp_path)))
            != model_fingerprint(config, source_identity("preset:tiny-qwen2")))


def test_folder_without_tokenizer_serves_token_ids_only(tmp_path):
    """Config + safetensors only: no tokenizer source (the scheduler then refuses text and chat
    with INVALID_ARGUMENT) rather than a folder the scheduler cannot load a tokenizer from."""
    hf_model("tiny").save_pretrained(tmp_path)
    assert tokenizer_source(str(tmp_path)) == ""
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_source(str(tmp_path)) == str(tmp_path.resolve())


def test_worker_warns_when_the_model_has_no_tokenizer(tmp_path, caplog):
    from executor_svc.worker import Worker

    hf_model("tiny").save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="executor_svc.worker"):
        info = Worker(ExecutorConfig(model=str(tmp_path), num_gpu_blocks=4,
                                     swap_space_gib=0.001)).info
    assert info.tokenizer == ""
    assert "no tokenizer: only token-id prompts will work" in caplog.text


def test_bfloat16_forward_close_to_float32():
    prompt = random_prompt(random.Random(30), 9)
    backend = get_backend("cpu")
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, config, _, _ = load_model("preset:tiny", dtype)
        assert model.embed_tokens.dtype == dtype
        cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, 4, 8, 1,
                            dtype, backend)
        positions, md = build_attention_metadata([[3, 0, 6]], [0], [9], 4, backend.device)
        hidden = model.forward(torch.tensor(prompt), positions, md, cache.kv_caches)
        logits[dtype] = model.compute_logits(hidden)
    error = (logits[torch.bfloat16] - logits[torch.float32]).abs().max()
    assert error < 0.02 * logits[torch.float32].abs().max()  # bf16 rounding, nothing structural


def test_llama3_8b_preset_shape():
    config = ModelConfig.from_hf_config(preset_hf_config("llama3-8b"))
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
        4096, 32, 32, 8, 128, 14336, 128256)
    assert config.rope_theta == 500000.0 and config.max_position_embeddings == 8192


def test_seeded_sampling_survives_recompute():
    """A sampled (temperature > 0) seq re-admitted with num_computed_tokens = 0 after state loss
    draws the same continuation: seeds are per position, not per step."""
    hf = hf_model("tiny")
    runner = make_runner(hf)
    opts = SamplingOptions(temperature=0.8, top_p=0.95, seed=1234)
    prompt = random_prompt(random.Random(31), 8)
    driver = PlanDriver(runner)
    driver.run(new_seqs=[driver.new_seq(1, prompt, sampling=opts)])
    for _ in range(5):
        driver.run(cached_seqs=[driver.cached_seq(1)])
    full = driver.tokens[1]
    runner.reset()
    again = PlanDriver(runner, seed=9)
    again.run(new_seqs=[again.new_seq(1, full[:len(prompt) + 3], sampling=opts)])
    for _ in range(2):
        again.run(cached_seqs=[again.cached_seq(1)])
    assert again.tokens[1] == full


def test_preset_fingerprint_names_where_the_weights_were_drawn():
    import torch

    from executor_svc.model_config import ModelConfig, preset_hf_config

    config = ModelConfig.from_hf_config(preset_hf_config("tiny"))
    tiny = source_identity("preset:tiny")
    cpu = model_fingerprint(config, tiny, 0, "cpu", torch.float32)
    assert cpu == model_fingerprint(config, tiny, 0, "cpu", torch.float32)
    assert cpu != model_fingerprint(config, tiny, 0, "cuda", torch.float32)
    assert cpu != model_fingerprint(config, tiny, 0, "cpu", torch.bfloat16)
    assert cpu != model_fingerprint(config, tiny, 1, "cpu", torch.float32)


def test_sliding_window_caps_the_context():
    from transformers import MistralConfig, Qwen2Config

    from executor_svc.model_config import ModelConfig

    mistral = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                            max_position_embeddings=8192, sliding_window=1024)
    assert ModelConfig.from_hf_config(mistral).max_context == 1024
    qwen = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                       max_position_embeddings=8192, sliding_window=1024, use_sliding_window=False)
    assert ModelConfig.from_hf_config(qwen).max_context == 8192
