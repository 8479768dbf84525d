"""The families of test_model_families on the CUDA backend: float32 greedy token-identical to
transformers on the GPU (chunked prefill, mixed steps through the piecewise graphs, decode-graph
replays, prompts past every window), and bf16 shapes our kernels cover (head_dim 64, and 128 where
Hopper runs the pipelined prefill kernel) within the bf16 rule of
helpers.compare_bf16_with_transformers, through the prefill and the few-query kernels."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.backends.cuda import FEW_QUERY_MAX, CudaBackend
from executor_svc.cuda_graphs import BATCH_SIZES
from executor_svc.model_config import ModelConfig
from executor_svc.step import StepLimits
from executor_svc.step_limits import piecewise_graph_sizes
from tests.executor_svc.helpers import (PlanDriver, bf16_reference,
                                        compare_bf16_with_transformers, hf_generate,
                                        random_prompt)
from tests.executor_svc.test_cuda_backend import gpu_runner
from tests.executor_svc.test_model_families import (FAMILIES, NUM_NEW, _prompts, family_model,
                                                    write_family_folder)
from tests.gpu import gpu_ready

CHUNK = 17  # seq 1's prefill chunks: a chunk's queries see keys cached by earlier steps
# bf16: the kernels' head size; a window that is no multiple of the 16-token block; weights
# drawn narrower than the float32 folders' (0.3), whose attention is near-argmax and so chaotic
# in bf16 that transformers' own bf16-vs-float32 distance (the tolerance) would pass anything.
BF16_WINDOW = 24
BF16_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=4096,
                  initializer_range=0.1)
BF16_NUM_NEW = 24
# Prompt lengths per kernel: one step of them is the first step of both runs of the rule.
BF16_LENGTHS = {"prefill": (37, 80, 129), "few-query": (30, 21, 13)}
# Phi-3's LongRoPE factor set must not switch mid-sequence in transformers: every sequence stays
# within the original context (short) or passes it from its prompt on (long).
BF16_PHI3_LENGTHS = {("phi3-short", "prefill"): (37, 80, 100), ("phi3-long", "few-query"): (60,)}


# Families whose deployed models have 128-dim heads (Qwen3, GLM-4; Gemma 2's soft-cap and windows
# beside them): on Hopper their prefill runs the pipelined kernel, the default there.
HD128_FAMILIES = ("gemma2", "glm4", "qwen3", "qwen3-full")


def bf16_config(family: str, head_dim: int = BF16_SHAPE["head_dim"]):
    """FAMILIES[family] at head_dim 64 (or `head_dim`; Phi-3's is hidden / heads: 256 / 4),
    windows of BF16_WINDOW on the same layers, LongRoPE factors for 32 frequencies, and Gemma 2's
    own final soft-cap (30: the folders' 3 saturates these logits into ties)."""
    cfg = FAMILIES[family]()
    fields = {**cfg.to_dict(), **BF16_SHAPE, "head_dim": head_dim}
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        fields["sliding_window"] = BF16_WINDOW
    rope = fields.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        rng = random.Random(5)
        half = BF16_SHAPE["head_dim"] // 2
        fields["rope_parameters"] = {**rope,
                                     "short_factor": [1 + rng.random() for _ in range(half)],
                                     "long_factor": [2 + 4 * rng.random() for _ in range(half)]}
    if family == "gemma2":
        fields["final_logit_softcapping"] = 30.0
    return type(cfg)(**fields)


def bf16_lengths(family: str, kernel: str) -> tuple[int, ...]:
    return BF16_PHI3_LENGTHS.get((family, kernel), BF16_LENGTHS[kernel])


def max_model_len(family: str, config: ModelConfig) -> int:
    """vLLM's rule for Phi-3's short factors: a max_model_len within the original context."""
    if family == "phi3-short":
        return config.rope_scaling.original_max_position_embeddings
    return config.max_position_embeddings


def cuda_runner(family: str, hf, dtype_name: str, **options):
    """gpu_runner (decode graphs and the worker's piecewise graphs captured, so mixed steps
    replay the family's pieces) at the family's max_model_len, LongRoPE's factor set chosen for
    it as the worker chooses it."""
    length = max_model_len(family, ModelConfig.from_hf_config(hf.config))
    options.setdefault("piece_sizes", piecewise_graph_sizes(StepLimits(8192, 1024, True, ""),
                                                            BATCH_SIZES))
    runner = gpu_runner(hf, dtype_name, max_model_len=length, **options)
    runner.model.set_max_model_len(length)
    return runner


def as_loaded_in_bf16(hf):
    """hf's parameters in bf16, its buffers as they were, as from_pretrained(dtype=bfloat16)
    leaves them: hf.to(bfloat16) would also round RoPE's inv_freq, a model nobody loads, whose
    angles drift from ours (and vLLM's) with position."""
    for param in hf.parameters():
        param.data = param.data.to(torch.bfloat16)
    return hf


def with_capping_attention(hf):
    """hf on transformers' eager attention where its config soft-caps attention logits (Gemma
    2): the SDPA path some transformers releases choose drops the cap without a word."""
    if getattr(hf.config, "attn_logit_softcapping", None) is not None:
        hf.config._attn_implementation = "eager"
    return hf


def without_eos(hf):
    """hf with no EOS in its generation config: else hf_generate's min_new_tokens masks the
    EOS logit (VOCAB is small: EOS comes up), which our greedy does not."""
    hf.generation_config.eos_token_id = None
    return hf


def chunked_greedy(runner, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Seq 1's prompt in CHUNK-token chunks; seq 2's whole prompt joins at step 2; one-token rows
    lead every mixed step (as the scheduler packs them); steps of decodes only replay a decode
    graph. Returns each seq's first num_new tokens."""
    driver = PlanDriver(runner)
    driver.run(new_seqs=[driver.new_seq(1, prompts[0], num_scheduled=CHUNK)])
    new_seqs, cached = [driver.new_seq(2, prompts[1])], [1]
    while cached:
        left = {s: len(driver.tokens[s]) - driver.computed[s] for s in cached}
        rows = [driver.cached_seq(s, num_scheduled=min(CHUNK, left[s]))
                for s in sorted(cached, key=lambda s: left[s] != 1)]
        driver.run(cached_seqs=rows, new_seqs=new_seqs)
        new_seqs = []
        cached = [s for s in (1, 2) if len(driver.tokens[s]) - len(prompts[s - 1]) < num_new]
    return [driver.tokens[s][len(p):len(p) + num_new] for s, p in zip((1, 2), prompts)]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_greedy_identical_to_transformers_on_gpu(family, tmp_path):
    """test_model_families' folders (head_dim 16 or 32: the torch attention twins, windows and
    soft-caps included), 64 tokens each, against transformers' generate on the GPU."""
    write_family_folder(family, tmp_path)
    hf = without_eos(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32))
    hf = with_capping_attention(hf.to("cuda").eval())
    runner = cuda_runner(family, hf, "float32")
    prompts = _prompts(family)
    ours = chunked_greedy(runner, prompts, NUM_NEW)
    expected = [hf_generate(hf, prompt, NUM_NEW) for prompt in prompts]
    del runner, hf
    torch.cuda.empty_cache()
    assert ours == expected


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("kernel", sorted(BF16_LENGTHS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_logits_within_tolerance_and_greedy_until_near_tie(family, kernel):
    """The bf16 rule of test_cuda_backend's presets, on bf16_config(family): the decode kernel
    in every decode-graph replay, the prefill or few-query kernel in the prompts' step."""
    _check_bf16_rule(family, bf16_config(family), bf16_lengths(family, kernel), 40,
                     f"{family} {kernel}")


def _check_bf16_rule(family: str, config, lengths: tuple[int, ...], seed: int, label: str):
    """Prompts of `lengths` on `config` (transformers in bf16 as loaded) through cuda_runner:
    logits within the bf16 tolerance, greedy identical until a near tie."""
    hf = as_loaded_in_bf16(with_capping_attention(without_eos(family_model(config))))
    hf = hf.to("cuda")
    rng = random.Random(seed)
    prompts = {s: random_prompt(rng, n, hf.config.vocab_size)
               for s, n in enumerate(lengths, start=1)}
    ref = bf16_reference(hf, prompts, BF16_NUM_NEW)
    runner = cuda_runner(family, hf, "bfloat16", sample_in_graphs=False)
    within, identical = compare_bf16_with_transformers(runner, ref, label)
    del runner, hf, ref
    torch.cuda.empty_cache()
    assert all(within.values()), within
    assert all(identical.values()), identical


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("family", HD128_FAMILIES)
def test_bf16_head_dim_128_prefill_within_tolerance_and_greedy_until_near_tie(family):
    """The same rule at head_dim 128 through the prefill kernel (the pipelined one on Hopper:
    windows, soft-caps and partial rotary included) and the decode graphs."""
    _check_bf16_rule(family, bf16_config(family, head_dim=128), bf16_lengths(family, "prefill"),
                     41, f"{family} hd128")


def test_bf16_shapes_switch_the_quirks_on_and_reach_the_kernels():
    """A guard on the test itself (runs without a GPU): the bf16 configs keep each family's
    quirks at a size the kernels cover, and the prompt lengths take the kernel they name."""
    cfg = {name: ModelConfig.from_hf_config(bf16_config(name)) for name in FAMILIES}
    for name, c in cfg.items():
        assert CudaBackend.kernels_cover(torch.bfloat16, c.head_dim), name
        assert c.num_heads == 2 * c.num_kv_heads, name
    w = BF16_WINDOW
    assert cfg["qwen3"].layer_windows == (None, w, w) and cfg["qwen3-full"].layer_windows == ()
    assert cfg["gemma2"].layer_windows == cfg["gemma3"].layer_windows == (w, None, w)
    assert cfg["gemma2"].attn_logit_softcapping == 5.0
    assert cfg["glm"].rotary_dim == cfg["glm4"].rotary_dim == 32 and cfg["glm4"].rope_interleaved
    assert len(cfg["phi3-long"].rope_scaling.long_factor) == 32
    for family in FAMILIES:
        for kernel in BF16_LENGTHS:
            lengths = bf16_lengths(family, kernel)
            assert (sum(lengths) <= FEW_QUERY_MAX) == (kernel == "few-query"), (family, kernel)
            assert max(lengths) > BF16_WINDOW
            # phi3-short: within the original context throughout, so transformers keeps the
            # short factors as we do
            assert max(lengths) + BF16_NUM_NEW <= max_model_len(family, cfg[family])
    long = cfg["phi3-long"].rope_scaling.original_max_position_embeddings
    assert min(min(bf16_lengths("phi3-long", k)) for k in BF16_LENGTHS) > long
    for name in HD128_FAMILIES:  # 128-dim heads, the quirks kept
        c = ModelConfig.from_hf_config(bf16_config(name, head_dim=128))
        assert c.head_dim == 128 and CudaBackend.kernels_cover(torch.bfloat16, 128), name
        assert sum(bf16_lengths(name, "prefill")) > FEW_QUERY_MAX, name
        assert c.layer_windows == cfg[name].layer_windows, name
    assert ModelConfig.from_hf_config(bf16_config("glm4", head_dim=128)).rotary_dim == 64
