"""Quantized checkpoints on the CPU backend, from the folders of quant_checkpoints (llm-compressor's
and the AWQ / GPTQ / FP8 layouts): each layer's weight equals the format's own dequantization
exactly, greedy output is token-identical in float32 to transformers running those dequantized
weights (FP8 activations quantized as W8A8 does), and a folder we cannot serve is refused in one
line naming the method, option or tensor."""
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.cache_engine import CacheEngine
from executor_svc.fingerprint import model_fingerprint
from executor_svc.model_loader import ModelSourceError, load_model
from executor_svc.quantization import Fp8Weight, Int4Weight
from pagedserve_kernels import reference
from tests.executor_svc.quant_checkpoints import FOLDERS, VOCAB, decompressed, hf_greedy, write_base

NUM_NEW, BLOCK_SIZE = 24, 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> (folder, {module: dequantized weight}, base folder), made on first use."""
    made, bases = {}, {}

    def folder(kind):
        if kind not in made:
            family, write = FOLDERS[kind]
            if family not in bases:
                bases[family] = write_base(tmp_path_factory.mktemp(family), family)
            path = tmp_path_factory.mktemp("q") / kind
            expected = write(bases[family], path)
            expected = expected if expected is not None else decompressed(path)
            made[kind] = (path, expected, bases[family])
        return made[kind]
    return folder


def _dense(weight):
    """A loaded linear as a dense [N, K] float32 weight in the checkpoint's input order."""
    if isinstance(weight, Fp8Weight) and weight.block_size is not None:
        (n, _), (bn, bk) = weight.shape, weight.block_size
        scale = weight.weight_scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)
        return weight.weight.float() * scale
    if isinstance(weight, Fp8Weight):
        return weight.weight.float() * weight.weight_scale[:, None]
    w = reference.dequantize_int4(weight.qweight, weight.scales, weight.zeros, weight.group_size)
    if weight.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, weight.perm] = w  # row k of qweight is input perm[k]
    return out


@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_each_layer_is_the_formats_dequantization(folders, kind):
    path, expected, _ = folders(kind)
    model, config, _, _ = load_model(str(path), "float32")
    weight_type = Fp8Weight if "fp8" in kind else Int4Weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        got = {"qkv": layer.qkv_proj, "o": layer.o_proj, "gate_up": layer.gate_up_proj,
               "down": layer.down_proj}
        want = {"qkv": [p + f"self_attn.{x}_proj" for x in "qkv"], "o": [p + "self_attn.o_proj"],
                "gate_up": [p + "mlp.gate_proj", p + "mlp.up_proj"], "down": [p + "mlp.down_proj"]}
        for product, weight in got.items():
            assert isinstance(weight, weight_type)
            assert torch.equal(_dense(weight), torch.cat([expected[m] for m in want[product]]))
    assert config.quantization is not None


def _our_greedy(model, config, prompt, chunk):
    """One seq: its prompt prefilled in chunks of `chunk` tokens, then NUM_NEW decode steps."""
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, 32,
                        1, torch.float32, model.backend)
    table, tokens, computed = list(range(31, -1, -1)), list(prompt), 0
    while len(tokens) - len(prompt) < NUM_NEW:
        count = min(chunk, len(tokens) - computed)
        positions, md = build_attention_metadata([table], [computed], [count], BLOCK_SIZE,
                                                 torch.device("cpu"))
        hidden = model.forward(torch.tensor(tokens[computed:computed + count]), positions, md,
                               cache.kv_caches)
        computed += count
        if computed == len(tokens):
            tokens.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_greedy_matches_transformers_on_the_dequantized_weights(folders, kind):
    path, expected, base = folders(kind)
    model, config, _, _ = load_model(str(path), "float32")
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    # One activation scale per step's tensor (the fp8 method's dynamic scheme, as in vLLM)
    # depends on the step's tokens: that folder prefills in one step, as transformers does.
    chunk = len(prompt) if kind == "fp8-dynamic" else 7
    ours = _our_greedy(model, config, prompt, chunk)
    assert ours == hf_greedy(kind, base, expected, prompt, NUM_NEW)
    assert len(set(ours)) > 4  # the output wanders: a comparison that can fail


def _variant(src, dst, config=None, tensors=None):
    """A copy of folder `src` with its quantization_config updated by `config` (a dict, or a
    function of it) and its tensors edited by `tensors` (a function of the dict)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if callable(config):
        config(cfg["quantization_config"])
    elif config:
        config = dict(config)  # "_top": keys outside quantization_config
        cfg = {**cfg, **config.pop("_top", {})}
        cfg["quantization_config"].update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _drop_activations(qc):
    qc["config_groups"]["group_0"]["input_activations"] = None


def _format(fmt):
    return lambda qc: qc["config_groups"]["group_0"].update(format=fmt)


L0 = "model.layers.0."
REFUSED_CONFIGS = [
    ("awq-g32", {"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not "
     "supported; supported: awq (4-bit, GEMM layout), gptq (4-bit), compressed-tensors"),
    ("awq-g32", {"bits": 8}, "awq with 8-bit weights is not supported; supported: 4-bit"),
    ("awq-g32", {"version": "gemv"}, "awq version 'gemv' is not supported; supported: 'gemm'"),
    ("gptq-g64-act-order", {"group_size": 256}, "gptq group_size 256 is not supported; "
     "supported: 32, 64, 128 or -1"),
    ("gptq-g64-act-order", {"bits": 3}, "gptq with 3-bit weights is not supported"),
    ("gptq-g64-act-order", {"dynamic": {"-:.*down_proj": {}}}, "gptq 'dynamic' per-module "
     "overrides are not supported"),
    ("fp8-static", {"weight_block_size": [128, 128]}, "fp8 with weight_block_size and "
     "activation_scheme 'static' is not supported; supported: 'dynamic' with block-wise scales"),
    ("fp8-block", {"weight_block_size": [128]}, "fp8 weight_block_size [128] is not supported; "
     "supported: two positive integers"),
    ("ct-fp8", _drop_activations, "FP8 weights without FP8 activations (W8A16) are not "
     "supported; supported: W8A8"),
    ("ct-w4a16", _format("int-quantized"), "format 'int-quantized' is not supported; supported: "
     "pack-quantized (W4A16), float-quantized (FP8 W8A8)"),
]


@pytest.mark.parametrize("kind, config, message", REFUSED_CONFIGS)
def test_an_unservable_quantization_config_is_refused_in_one_line(folders, tmp_path, kind,
                                                                  config, message):
    path = _variant(folders(kind)[0], tmp_path / "bad", config=config)
    with pytest.raises(ModelSourceError) as err:
        load_model(str(path), "float32")
    assert message in str(err.value) and "\n" not in str(err.value)


def _pop(name):
    return lambda state: state.pop(name)


def _set(name, value):
    return lambda state: state.update({name: value(state[name])})


def _g_idx_zero(state):
    for x in "qkv":
        state[L0 + f"self_attn.{x}_proj.g_idx"].zero_()


REFUSED_TENSORS = [
    ("gptq-g64-act-order", None, _pop("model.layers.1.mlp.down_proj.scales"),
     "model.layers.1.mlp.down_proj.scales is missing"),
    ("awq-g32", None, _set(L0 + "self_attn.k_proj.qzeros", lambda t: t[1:].clone()),
     "model.layers.0.self_attn.k_proj.qzeros has shape [3, 8]; the layer and its "
     "quantization_config make it [4, 8]"),
    ("gptq-g64-act-order", None, _g_idx_zero, "model.layers.0.self_attn.q_proj.g_idx does not "
     "assign 64 input rows to each of 2 groups"),
    ("gptq-g64-act-order", {"sym": True}, None, "model.layers.0.self_attn.q_proj.qzeros holds "
     "zero points other than 8, but the quantization_config says sym: true"),
    ("gptq-v2-g32", {"group_size": 64, "_top": {"intermediate_size": 160}}, None,
     "model.layers.0.mlp.down_proj: group_size 64 does not divide its input dimension 160"),
    ("ct-fp8", None, _set(L0 + "self_attn.q_proj.weight_scale", lambda t: t[:1, 0].clone()),
     "model.layers.0.self_attn.q_proj.weight_scale is torch.float32 of shape [1]; expected one "
     "float scale or one per output row (128)"),
    ("fp8-block", {"weight_block_size": [128, 32]}, None, "model.layers.0.self_attn.q_proj"
     ".weight_scale_inv has shape [2, 4]; the layer and its quantization_config make it [1, 4]"),
    ("fp8-static", None, _set(L0 + "mlp.up_proj.weight", lambda t: t.float()),
     "model.layers.0.mlp.up_proj.weight is torch.float32; expected torch.float8_e4m3fn"),
    ("awq-g32", None, lambda s: s.update({"lm_head.qweight": s[L0 + "mlp.up_proj.qweight"] + 0}),
     "lm_head.qweight is torch.int32, but no linear the quantization_config (awq int4 g32) "
     "quantizes reads it"),
    ("awq-g32", {"modules_to_not_convert": ["k_proj"]}, None, "model.layers.0.self_attn.k_proj"
     ".qweight is torch.int32, but no linear the quantization_config"),
]


@pytest.mark.parametrize("kind, config, tensors, message", REFUSED_TENSORS)
def test_tensors_that_disagree_with_the_config_are_refused_naming_the_tensor(
        folders, tmp_path, kind, config, tensors, message):
    path = _variant(folders(kind)[0], tmp_path / "bad", config=config, tensors=tensors)
    with pytest.raises(ModelSourceError) as err:
        load_model(str(path), "float32")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_cuda_backend_takes_per_channel_fp8_and_refuses_block_wise_in_one_line(folders):
    from executor_svc.backends.cuda import CudaBackend

    _, config, _, _ = load_model(str(folders("ct-fp8")[0]), "float32")
    CudaBackend.check_model(config)
    _, config, _, _ = load_model(str(folders("fp8-block")[0]), "float32")
    with pytest.raises(ValueError, match=r"^fp8 w8a8 dynamic block \d+x\d+ needs a block-wise FP8 "
                                         "product, which the CUDA backend does not have yet"):
        CudaBackend.check_model(config)


def test_the_fingerprint_covers_the_quantization(folders):
    _, config, _, _ = load_model(str(folders("gptq-g64-act-order")[0]), "float32")
    assert config.quantization == "gptq int4 g64 asym act-order"
    identity = {"weights": {"model.safetensors": "digest"}, "tokenizer": {}}
    dense = model_fingerprint(dataclasses.replace(config, quantization=None), identity)
    assert model_fingerprint(config, identity) != dense


def test_fp8_activation_scales_follow_vllms_rule():
    """scale = max(amax / 448, 1 / (448 * 512)): an all-zero token quantizes to zeros, not NaN;
    the largest magnitude lands on +-448; per tensor, one scale for all tokens."""
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -448.0 * 3, 2.0, 0.5]])
    q, scale = reference.quantize_fp8(x)
    assert torch.equal(scale[0], torch.tensor([1 / (448 * 512)]))
    assert torch.equal(q[0].float(), torch.zeros(4))
    assert scale[1].item() == 3.0 and q[1, 1].item() == -448.0
    q, scale = reference.quantize_fp8(x, per_token=False)
    assert scale.shape == (1, 1) and scale.item() == 3.0 and not q[0].float().any()
    q, scale = reference.quantize_fp8(x, torch.tensor(1.0))  # static: clamped at +-448
    assert scale.item() == 1.0 and q[1, 1].item() == -448.0


def test_per_token_fp8_rows_come_quantized_from_the_op_before_and_change_nothing(
        folders, monkeypatch):
    """llm-compressor's FP8 dynamic folder: every input norm, post-attention norm and
    SiLU-and-mul hands its product the rows quantized (an Fp8Activation), and a step's hidden
    states equal those of the products quantizing their own rows, bit for bit."""
    from executor_svc.backends import cpu
    from executor_svc.quantization import Fp8Activation

    path, _, _ = folders("ct-fp8")
    model, config, _, _ = load_model(str(path), "float32")
    handed = []
    linear = model.backend.linear

    def spying_linear(x, weight, bias=None, out=None):
        handed.append(isinstance(x, Fp8Activation))
        return linear(x, weight, bias, out)

    def step():
        cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                            8, 1, torch.float32, model.backend)
        positions, md = build_attention_metadata([[0, 1, 2, 3]], [0], [13], BLOCK_SIZE,
                                                 torch.device("cpu"))
        ids = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(3))
        return model.forward(ids, positions, md, cache.kv_caches)

    monkeypatch.setattr(model.backend, "linear", spying_linear)
    fused = step()
    assert handed.count(True) == 3 * config.num_layers  # qkv, gate|up and down of every layer
    monkeypatch.setattr(cpu, "takes_fp8_rows", lambda weight: False)
    handed.clear()
    assert torch.equal(step(), fused) and not any(handed)
