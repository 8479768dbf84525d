"""GGUF files of the new families, written here with gguf.GGUFWriter in llama.cpp's layout (names,
metadata and tensor conversions as llama.cpp's converter writes them, conversion/*.py of
ggml-org/llama.cpp) from the weights of a random transformers folder: our loader's greedy output
is token-identical in float32 to transformers on that folder (F32 tensors), and to transformers on
the dequantized weights for a Q8_0 file; the tokenizers the scheduler builds from such files."""
import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model_loader import ModelSourceError, check_model_source, load_model
from scheduler_svc.tokenizer import load_tokenizer
from tests.executor_svc.test_model_families import (_SHAPE, VOCAB, WINDOW, _glm4, _hf_greedy,
                                                    _our_greedy, _phi3_long, _prompts)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_SHAPE, rope_theta=1e5, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_SHAPE, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)


def _gemma2():
    """Tied (llama.cpp's Gemma2Model drops lm_head); query_pre_attn_scalar = head_dim, which is
    what llama.cpp assumes of every Gemma 2 but the 27B."""
    from transformers import Gemma2Config

    return Gemma2Config(**_SHAPE, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)


def _gemma3():
    """Six layers: llama.cpp fixes Gemma 3's pattern at five local layers and one global."""
    from transformers import Gemma3TextConfig

    shape = dict(_SHAPE, num_hidden_layers=6)
    return Gemma3TextConfig(**shape, head_dim=32, query_pre_attn_scalar=32,
                            sliding_window=WINDOW, sliding_window_pattern=6, rope_theta=1e6,
                            rope_local_base_freq=10000.0,
                            rope_scaling=dict(rope_type="linear", factor=4.0),
                            tie_word_embeddings=False)


# family -> (its transformers config, llama.cpp's architecture, tokenizer model)
FAMILIES = {"llama": (_llama, "llama", "gpt2"), "qwen3": (_qwen3, "qwen3", "gpt2"), "phi3-long": (_phi3_long, "phi3", "llama"),
            "glm4": (_glm4, "glm4", "gpt2"), "gemma2": (_gemma2, "gemma2", "llama"),
            "gemma3": (_gemma3, "gemma3", "llama")}


def _hf_model(family):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(FAMILIES[family][0]()).eval()
    with torch.no_grad():  # norms and biases start constant: a swapped pair would pass
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.2)
    return hf


def _rope(cfg, layer_type="full_attention") -> dict:
    params = dict(cfg.rope_parameters or {})
    return dict(params.get(layer_type, params))


def _write_metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    """The keys each arch's set_gguf_parameters writes: TextModel's (conversion/base.py) for
    llama (LlamaModel adds vocab_size and rope.dimension_count), qwen3, glm4 (Glm4Model adds
    rope.dimension_count) and gemma3 (Gemma3Model then rewrites some); Phi3MiniModel's and
    Gemma2Model's own, which call no super."""
    rope = _rope(cfg)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)
    if arch in ("llama", "qwen3", "glm4", "gemma3"):
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_freq_base(rope["rope_theta"])
        if "sliding_attention" in (cfg.rope_parameters or {}):
            w.add_rope_freq_base_swa(_rope(cfg, "sliding_attention")["rope_theta"])
    if arch != "phi3":  # every config here has head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "glm4":
        w.add_rope_dimension_count(int(cfg.head_dim * rope["partial_rotary_factor"]))
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)


def _tensors(hf, arch: str):
    """(llama.cpp name, float32 array) as modify_tensors yields them: names through the gguf
    package's TensorNameMap (map_tensor_name), Gemma norms + 1 (Gemma2Model / Gemma3Model), Q/K
    rows permuted for llama.cpp's RoPE by LlamaModel only, lm_head dropped for Gemma 2; Phi-3's
    LongRoPE factors from generate_extra_tensors."""
    cfg = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if arch == "gemma3" and name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _llama_permute(data, heads)
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), data.numpy()
    if arch == "phi3":
        rope = _rope(cfg)
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def _llama_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """LlamaModel.permute of the converter (conversion/llama.py)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_vocab(w: gguf.GGUFWriter, model: str) -> None:
    """A VOCAB-token vocabulary of the family's tokenizer model: byte-level BPE with merges
    (_set_vocab_gpt2) or sentencepiece pieces with scores and byte tokens
    (_set_vocab_sentencepiece)."""
    w.add_tokenizer_model(model)
    if model == "gpt2":
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        merges = [(a, b) for a in "Ġetaoinsrhl" for b in "etaoinsrhlcdumwfgypbvkxjqz"]
        merges = merges[:VOCAB - 256 - 3]
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tokens += list(bytes_to_unicode().values()) + [a + b for a, b in merges]
        w.add_tokenizer_pre("glm4" if w.arch == "glm4" else "qwen2")
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
    else:
        # the family's own special tokens first: Gemma's tokenizer adds those it misses
        specials = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if w.arch.startswith("gemma")
                    else ["<unk>", "<s>", "</s>"])
        letters = "abcdefghijklmnopqrstuvwxyz"
        pieces = ["▁"] + ["▁" + c for c in letters] + list(letters)
        pieces += [f"▁{a}{b}" for a in "etaoin" for b in "etaoinsrhlmcdu"]
        tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
        tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
        n = len(specials) + 256
        types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.BYTE] * 256
        types[specials.index("<unk>")] = gguf.TokenType.UNKNOWN
        types += [gguf.TokenType.NORMAL] * (VOCAB - n)
        w.add_tokenizer_pre("default")
        w.add_token_scores([0.0] * n + [-float(i) for i in range(VOCAB - n)])
        w.add_bos_token_id(tokens.index("<bos>" if "<bos>" in tokens else "<s>"))
        w.add_eos_token_id(tokens.index("<eos>" if "<eos>" in tokens else "</s>"))
        w.add_unk_token_id(specials.index("<unk>"))
    assert len(tokens) == VOCAB
    w.add_token_list(tokens)
    w.add_token_types(types)


def write_gguf(hf, family: str, path, qtype=gguf.GGMLQuantizationType.F32) -> None:
    _, arch, tokenizer_model = FAMILIES[family]
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, hf.config, arch)
    _write_vocab(w, tokenizer_model)
    for name, data in _tensors(hf, arch):
        # as llama.cpp's converter: 1-D tensors (norms, biases, factors) stay F32
        kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (the GGUF path, the transformers folder it was written from)."""
    made = {}

    def make(family):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            hf = _hf_model(family)
            hf.save_pretrained(folder)
            write_gguf(hf, family, folder / "model.gguf")
            made[family] = (str(folder / "model.gguf"), str(folder))
        return made[family]
    return make


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_greedy_matches_transformers_on_the_folder(files, family):
    path, folder = files(family)
    model, config, tokenizer, _ = load_model(path, "float32")
    assert tokenizer == path
    prompts = _prompts(family)
    ours = _our_greedy(model, config, prompts, config.max_position_embeddings)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(folder, prompt), family


def test_gguf_config_carries_each_familys_quirks(files):
    configs = {f: load_model(files(f)[0], "float32")[1] for f in ("qwen3", "gemma3", "phi3-long")}
    assert configs["qwen3"].qk_norm and not configs["qwen3"].tie_word_embeddings
    g3 = configs["gemma3"]
    assert g3.layer_windows == (WINDOW,) * 5 + (None,) and g3.local_rope_theta == 10000.0
    assert g3.rope_scaling.factor == 4.0 and g3.attn_scale == 32**-0.5
    assert configs["phi3-long"].rope_scaling.original_max_position_embeddings == 32


def test_a_q8_0_file_matches_transformers_on_its_dequantized_weights(tmp_path):
    """Dequantized by the gguf package, as llama.cpp's own dequantization does."""
    hf = _hf_model("qwen3")
    write_gguf(hf, "qwen3", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    model, config, _, _ = load_model(str(tmp_path / "q8.gguf"), "float32")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 2:
                q = gguf.quants.quantize(param.numpy(), gguf.GGMLQuantizationType.Q8_0)
                deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
                assert not np.array_equal(deq, param.numpy())  # the file really is quantized
                param.copy_(torch.from_numpy(deq.reshape(param.shape)))
    hf.save_pretrained(tmp_path / "dequantized")
    prompts = _prompts("qwen3")
    ours = _our_greedy(model, config, prompts, config.max_position_embeddings)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(str(tmp_path / "dequantized"), prompt)


@pytest.mark.parametrize("family", ["qwen3", "glm4", "gemma2", "phi3-long"])
def test_the_scheduler_builds_each_familys_gguf_tokenizer(files, family):
    tokenizer = load_tokenizer(files(family)[0])
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.eos_token_id == (1 if family.startswith("gemma") else 2)
    text = "oath tie" if FAMILIES[family][2] == "llama" else "oath tie 123456"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    if family == "glm4":  # llama.cpp splits GLM-4's digits by three (its CHATGLM4 regex)
        split = tokenizer.hf_tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("123456")
        assert [piece for piece, _ in split] == ["123", "456"]


def test_an_unsupported_gguf_architecture_is_refused_in_one_line(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "chatglm")
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ModelSourceError, match="unsupported GGUF architecture 'chatglm'; "
                                               "pagedserve loads llama, qwen2, qwen3"):
        check_model_source(str(tmp_path / "m.gguf"))

