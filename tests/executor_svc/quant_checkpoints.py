"""Quantized model folders for tests, from a random-weight tiny Llama / Qwen2: written by
llm-compressor (W4A16 GPTQ recipe, FP8 dynamic and block-wise) or packed here in AutoAWQ's,
GPTQModel's, AutoFP8's and transformers' FineGrainedFP8 layouts, following their published pack
code; each writer returns every quantized linear's dequantized weight. And transformers' greedy
output on those dequantized weights (the reference)."""
import json
import re

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig

VOCAB = 512
_SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3,
              tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ WQLinear_GEMM.from_linear's order_map


def hf_config(family, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return cls(**{**_SHAPE, **overrides})


def write_base(folder, family, **overrides):
    """A random-weight model folder (Qwen2's q/k/v biases made non-zero)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.5)
    hf.save_pretrained(folder)
    return folder


# -- packers following the tools' published layouts ----------------------------------------------

def _int4_groups(w, group, sym, g_idx):
    """Min-max 4-bit quantization of w [N, K] per (row, group): (q [N, K], zeros [G, N] int,
    scales [G, N] float16); groups by g_idx [K]."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    q = torch.empty(n, k, dtype=torch.int32)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if sym:
            s = (part.abs().amax(dim=1) / 7).half()
            z = torch.full((n,), 8, dtype=torch.int32)
        else:
            lo, hi = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).half()
            z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int32)
        q[:, cols] = torch.round(part / s.float()[:, None] + z[:, None]).clamp(0, 15).int()
        zeros[g], scales[g] = z, s
    return q, zeros, scales


def _dequant(q, zeros, scales, g_idx):
    """The format description: W[n, k] = (q[n, k] - zero[g_idx[k], n]) * scale[g_idx[k], n]."""
    return (q - zeros[g_idx].t()).float() * scales[g_idx].t().float()


def input_of(name):
    """Act-order sorts a layer's inputs by its Hessian: q/k/v (and gate/up) share theirs."""
    return re.sub(r"[kv]_proj", "q_proj", name).replace("up_proj", "gate_proj")


def _pack_awq_cols(x):
    """AutoAWQ: [R, C] -> [R, C/8]; column col*8 + order_map[i] into bits 4i of word col."""
    packed = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int32)
    for col in range(x.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= x[:, col * 8 + AWQ_ORDER[i]].int() << (i * 4)
    return packed


def _pack_gptq_rows(x):
    """GPTQ QuantLinear.pack: [R, C] -> [R/8, C]; row 8r + j into bits 4j of word r."""
    packed = torch.zeros(x.shape[0] // 8, x.shape[1], dtype=torch.int32)
    for r in range(packed.shape[0]):
        for j in range(8):
            packed[r] |= x[8 * r + j].int() << (4 * j)
    return packed


def write_int4(base, folder, method, group, sym=False, desc_act=False, v2=False):
    """AutoAWQ GEMM or GPTQ (v1 unless v2) tensors for every layer linear; returns
    {module: dequantized weight [N, K] float32}."""
    tensors, expected, orders = dict(load_file(base / "model.safetensors")), {}, {}
    gen = torch.Generator().manual_seed(1)
    for name in [n[:-len(".weight")] for n in list(tensors) if n[:-len(".weight")].endswith(
            LINEARS)]:
        w = tensors.pop(name + ".weight").float()
        k = w.shape[1]
        size = k if group == -1 else group
        order = orders.setdefault(input_of(name), torch.randperm(k, generator=gen) if desc_act
                                  else torch.arange(k))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // size).int()  # GPTQ act-order: groups of sorted cols
        q, zeros, scales = _int4_groups(w, size, sym, g_idx)
        expected[name] = _dequant(q, zeros, scales, g_idx)
        tensors[name + ".scales"] = scales
        if method == "awq":
            tensors[name + ".qweight"] = _pack_awq_cols(q.t())
            tensors[name + ".qzeros"] = _pack_awq_cols(zeros)
        else:
            stored = zeros if v2 else (zeros - 1) & 0xF  # v1: zero points stored minus one
            tensors[name + ".qweight"] = _pack_gptq_rows(q.t().contiguous())
            tensors[name + ".qzeros"] = _pack_gptq_rows(stored.t().contiguous()).t().contiguous()
            tensors[name + ".g_idx"] = g_idx
    quant = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None} if method == "awq" else
             {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
              "sym": sym, "lm_head": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    _save(base, folder, tensors, quant)
    return expected


def write_fp8(base, folder, static, block=None):
    """AutoFP8's fp8 layout: e4m3 weight, one float32 weight_scale per layer (input_scale too
    when static); with `block` (bn, bk), transformers' FineGrainedFP8 / DeepSeek-V3 layout: a
    weight_scale_inv per [bn, bk] block (the multiplier that dequantizes). Returns {module:
    dequantized weight}."""
    tensors, expected = dict(load_file(base / "model.safetensors")), {}
    for name in [n[:-len(".weight")] for n in list(tensors) if n[:-len(".weight")].endswith(
            LINEARS)]:
        w = tensors.pop(name + ".weight").float()
        if block:
            (n, k), (bn, bk) = w.shape, block
            blocks = w.reshape(n // bn, bn, k // bk, bk)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [N / bn, K / bk]
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            tensors[name + ".weight_scale_inv"] = scale
        else:
            scale = full = w.abs().amax() / 448.0
            tensors[name + ".weight_scale"] = scale.reshape(())
        qw = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name + ".weight"] = qw
        if static:
            tensors[name + ".input_scale"] = torch.tensor(0.02)
        expected[name] = qw.float() * full
    quant = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
             "ignored_layers": ["lm_head"]}
    if block:
        quant["weight_block_size"] = list(block)
    _save(base, folder, tensors, quant)
    return expected


def write_ct_fp8(base, folder):
    """llm-compressor's FP8_DYNAMIC layout (compressed-tensors: per-channel e4m3 weights, dynamic
    per-token activations) packed by benchmarks/quant_folder.py, without llm-compressor (which
    the GPU machine lacks). Returns {module: dequantized weight}."""
    from benchmarks.quant_folder import fp8_tensors, quantization_config

    tensors, expected = dict(load_file(base / "model.safetensors")), {}
    for name in [n[:-len(".weight")] for n in list(tensors) if n[:-len(".weight")].endswith(
            LINEARS)]:
        parts = fp8_tensors(tensors.pop(name + ".weight"))
        tensors[name + ".weight"] = parts["weight"]
        tensors[name + ".weight_scale"] = parts["weight_scale"]
        expected[name] = parts["weight"].float() * parts["weight_scale"]
    _save(base, folder, tensors, quantization_config("fp8"))
    return expected


def _save(base, folder, tensors, quant):
    folder.mkdir()
    config = json.loads((base / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})


def llm_compressor(base, folder, kind):
    """llm-compressor's oneshot on the base folder: the W4A16 GPTQ recipe (asymmetric, group
    32, weight act-order) over random token ids, or FP8 dynamic (per-channel weights,
    per-token activations)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if kind == "fp8":
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC",
                                                         ignore=["lm_head"]))
    elif kind == "fp8-block":  # FP8_BLOCK's scheme with blocks the tiny model has several of
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        group = {"targets": ["Linear"], "weights": {**fp8, "strategy": "block",
                                                    "block_structure": [32, 64]},
                 "input_activations": {**fp8, "strategy": "group", "group_size": 64,
                                       "dynamic": True}}
        oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": group},
                                                         ignore=["lm_head"]))
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                   "group_size": 32, "actorder": "weight"}
        recipe = GPTQModifier(ignore=["lm_head"], config_groups={
            "group_0": {"targets": ["Linear"], "weights": weights}})
        gen = torch.Generator().manual_seed(2)
        data = Dataset.from_dict({"input_ids": [torch.randint(3, VOCAB, (32,), generator=gen)
                                                .tolist() for _ in range(8)]})
        vocab = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="t0")
        oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe,
                num_calibration_samples=8, max_seq_length=32)
    model.save_pretrained(folder, save_compressed=True)


def ct_group_order(base, folder):
    """compressed-tensors' act-order layout of earlier releases (actorder "group", since removed
    from the tools): the W4A16 folder's input columns shuffled, each column's group in
    weight_g_idx (GPTQ's g_idx), repacked with compressed-tensors' own pack_to_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                       unpack_from_int32)

    src = folder.parent / (folder.name + "-src")
    llm_compressor(base, src, "w4a16")
    dense, tensors = decompressed(src), dict(load_file(src / "model.safetensors"))
    gen, orders, expected = torch.Generator().manual_seed(3), {}, {}
    for name in dense:
        shape = torch.Size(tensors[name + ".weight_shape"].tolist())
        order = orders.setdefault(input_of(name), torch.randperm(shape[1], generator=gen))
        q = unpack_from_int32(tensors[name + ".weight_packed"], 4, shape)  # [N, K] int8
        tensors[name + ".weight_packed"] = pack_to_int32(q[:, order].contiguous(), 4)
        tensors[name + ".weight_g_idx"] = (order // 32).int()
        expected[name] = dense[name][:, order]
    quant = json.loads((src / "config.json").read_text())["quantization_config"]
    quant["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    _save(base, folder, tensors, quant)
    return expected


def decompressed(folder):
    """{module: weight} as compressed-tensors' own decompressor gives it, through transformers."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    return {n[:-len(".weight")]: p.detach() for n, p in hf.state_dict().items()
            if n[:-len(".weight")].endswith(LINEARS)}


# (family, writer) per folder; a writer returns {module: dequantized weight} or None (then
# compressed-tensors' decompressor says)
FOLDERS = {
    "ct-w4a16": ("llama", lambda b, f: llm_compressor(b, f, "w4a16")),
    "ct-w4a16-group-order": ("llama", ct_group_order),
    "ct-fp8": ("qwen2", lambda b, f: llm_compressor(b, f, "fp8")),
    "ct-fp8-block": ("llama", lambda b, f: llm_compressor(b, f, "fp8-block")),
    "awq-g128": ("qwen2", lambda b, f: write_int4(b, f, "awq", 128)),
    "awq-g32": ("llama", lambda b, f: write_int4(b, f, "awq", 32)),
    "gptq-g64-act-order": ("llama", lambda b, f: write_int4(b, f, "gptq", 64, desc_act=True)),
    "gptq-sym-channel": ("qwen2", lambda b, f: write_int4(b, f, "gptq", -1, sym=True)),
    "gptq-v2-g32": ("llama", lambda b, f: write_int4(b, f, "gptq", 32, v2=True)),
    "fp8-static": ("qwen2", lambda b, f: write_fp8(b, f, static=True)),
    "fp8-dynamic": ("llama", lambda b, f: write_fp8(b, f, static=False)),
    "fp8-block": ("qwen2", lambda b, f: write_fp8(b, f, static=False, block=(64, 32))),
}
# how transformers' reference quantizes a W8A8 folder's activations: (scale per token, static
# scale, inputs per scale group)
W8A8 = {"ct-fp8": (True, None, None), "fp8-static": (False, 0.02, None),
        "fp8-dynamic": (False, None, None), "ct-fp8-block": (True, None, 64),
        "fp8-block": (True, None, 32)}


def _fake_quant_fp8(args, per_token, static, group):
    """Activations as W8A8 sees them (written from the description: scale = amax / 448 per token,
    per token and group of inputs, or per tensor, or the static one; e4m3 round to nearest)."""
    x = args[0]
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    if static is not None:
        scale = torch.tensor(static)
    else:
        amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
        scale = (amax / 448.0).clamp(min=1 / (448.0 * 512))
    return ((x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(shape),


def hf_greedy(kind, base, expected, prompt, num_new):
    """transformers on the base weights with every quantized linear replaced by its
    dequantization (and W8A8's activation quantization as a forward pre-hook)."""
    family = FOLDERS[kind][0]
    hf = AutoModelForCausalLM.from_config(hf_config(family)).eval()
    state = load_file(base / "model.safetensors")
    hf.load_state_dict({**state, **{m + ".weight": w for m, w in expected.items()}})
    for module_name in expected:
        if kind in W8A8:
            hf.get_submodule(module_name).register_forward_pre_hook(
                lambda m, a, how=W8A8[kind]: _fake_quant_fp8(a, *how))
    gen = GenerationConfig(max_new_tokens=num_new, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long),
                          generation_config=gen)
    return out[0, len(prompt):].tolist()
