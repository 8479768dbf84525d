"""--kv-cache-dtype fp8 on the CPU runner: greedy output token-identical to transformers in
float32 whose attention applies the same FP8 round trip to K and V (per-layer scales), through
batching, chunked prefill, swap, copy-on-write and prefix caching; logits close to a float32
cache; scales read from checkpoints by vLLM's rules; the CUDA backend taking it (its kernels:
test_fp8_kv_cache_gpu.py); Describe, the fingerprint and the page arithmetic."""
import random

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from executor_svc import wire as executor_wire
from executor_svc.attention_metadata import build_attention_metadata
from executor_svc.backends import get_backend
from executor_svc.backends.cuda import CudaBackend
from executor_svc.cache_engine import CacheEngine, bytes_per_block
from executor_svc.fingerprint import model_fingerprint
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import build_hf_model, model_from_hf
from executor_svc.model_runner import ModelRunner
from executor_svc.quantization import QuantizationError, parse_quantization_config
from executor_svc.quantization.kv_cache import kv_cache_scales
from executor_svc.step import ExecutorInfo
from pagedserve_kernels import reference
from scheduler_svc import wire as scheduler_wire
from tests.executor_svc.helpers import (PlanDriver, RunnerLink, ScheduledRun, fork_on_write,
                                        hf_greedy, random_prompt, two_seqs_decoding)
from tests.executor_svc.test_prefix_caching import (assert_pools_whole, caching_scheduler,
                                                    greedy_seq)

FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 4
# (k_scale, v_scale) per layer of the tiny preset, whose K and V reach about 8: scaled near
# amax / 448 as a calibrated checkpoint's, and vLLM's default 1.0
SCALES = [(0.02, 0.018), (1.0, 1.0)]


def roundtrip_attention(scales):
    """A transformers attention function that stores K and V as the FP8 cache does (x / scale to
    e4m3, back times scale) before sdpa. Its key and value are the whole cache each step; the
    round trip is idempotent, so earlier rows stay as first stored."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = (torch.tensor(s) for s in scales[module.layer_idx])
        key = reference.dequantize_kv(reference.quantize_kv(key, k_scale), k_scale)
        value = reference.dequantize_kv(reference.quantize_kv(value, v_scale), v_scale)
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    return attention


def fp8_reference(preset: str, scales):
    """The preset's transformers model (float32) with the round-trip attention."""
    name = f"fp8-kv-{preset}-{scales}"
    AttentionInterface.register(name, roundtrip_attention(scales))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    hf = build_hf_model(preset, seed=0)
    hf.set_attn_implementation(name)
    return hf


def make_runner(preset: str, scales, kv_dtype=FP8, num_gpu_blocks=64, num_cpu_blocks=32
                ) -> ModelRunner:
    """A runner on the preset's weights with a cache of `kv_dtype` and the given scales (what the
    loader reads from a checkpoint)."""
    backend = get_backend("cpu")
    hf = build_hf_model(preset, seed=0)
    config = ModelConfig.from_hf_config(hf.config)
    model = model_from_hf(hf, config, backend)
    model.kv_scales = [(torch.tensor(k), torch.tensor(v)) for k, v in scales]
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                        num_gpu_blocks, num_cpu_blocks, kv_dtype, backend)
    info = ExecutorInfo("test", "fp", "float32", BLOCK_SIZE, num_gpu_blocks, num_cpu_blocks, 512,
                        config.vocab_size, "", "cpu", kv_cache_dtype="fp8_e4m3")
    return ModelRunner(model, backend, cache, info)


def decode_until(driver: PlanDriver, prompts: dict, num_new: int) -> None:
    while min(len(driver.tokens[s]) - len(prompts[s]) for s in prompts) < num_new:
        driver.run(cached_seqs=[driver.cached_seq(s) for s in prompts
                                if len(driver.tokens[s]) - len(prompts[s]) < num_new])


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_batched_chunked_greedy_matches_transformers_with_the_same_fp8_round_trip(preset):
    runner = make_runner(preset, SCALES)
    assert runner.cache_engine.gpu_k.dtype == FP8
    driver = PlanDriver(runner)
    rng = random.Random(20)
    prompts = {1: random_prompt(rng, 5), 2: random_prompt(rng, 14), 3: random_prompt(rng, 2)}
    driver.run(new_seqs=[driver.new_seq(1, prompts[1]), driver.new_seq(2, prompts[2], 6)])
    driver.run(new_seqs=[driver.new_seq(3, prompts[3])],
               cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    decode_until(driver, prompts, 12)
    hf = fp8_reference(preset, SCALES)
    for seq_id, prompt in prompts.items():
        new = driver.tokens[seq_id][len(prompt):]
        assert new == hf_greedy(hf, prompt, len(new)), seq_id


def step_logits(runner: ModelRunner, tokens: list[int], steps: int) -> torch.Tensor:
    """[1 + steps, vocab]: the logits of a prefill of `tokens`, then of `steps` decode steps fed
    with token ids drawn from `tokens` (the same inputs for every cache)."""
    model, (k, v) = runner.model, runner.cache_engine.kv_caches
    table = list(range(-(-(len(tokens) + steps) // BLOCK_SIZE)))
    out, done = [], 0
    for n in [len(tokens)] + [1] * steps:
        ids = torch.tensor((tokens * 2)[done:done + n])
        positions, md = build_attention_metadata([table], [done], [n], BLOCK_SIZE, "cpu")
        hidden = model.forward(ids, positions, md, (k, v))
        out.append(model.compute_logits(hidden[-1:]))
        done += n
    return torch.cat(out)


def test_logits_stay_close_to_a_float32_cache():
    """The FP8 cache's error on the tiny preset over a 24-token prefill and 8 decode steps stays
    within bounds set a margin above what it makes (calibrated scales tighter than 1.0); the
    calibrated cache keeps the float32 cache's argmax at all but one step."""
    tokens = random_prompt(random.Random(21), 24)
    exact = step_logits(make_runner("tiny", SCALES, torch.float32), tokens, 8)
    for scales, max_diff, same_argmax in ((SCALES, 2.0, 8), ([(1.0, 1.0)] * 2, 3.0, 6)):
        fp8 = step_logits(make_runner("tiny", scales), tokens, 8)
        diff = (fp8 - exact).abs()
        assert 0 < diff.max().item() < max_diff, (scales, diff.max().item())
        assert diff.mean().item() < 0.3, (scales, diff.mean().item())
        assert (fp8.argmax(-1) == exact.argmax(-1)).sum().item() >= same_argmax, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_swap_out_and_in_carry_fp8_pages_exactly():
    runner = make_runner("tiny", SCALES)
    cache, driver = runner.cache_engine, PlanDriver(runner)
    prompts = two_seqs_decoding(driver, 22)
    old_table = driver.tables.pop(1)
    pages = bits(cache.gpu_k[:, old_table]).clone(), bits(cache.gpu_v[:, old_table]).clone()
    cpu_blocks = [20 + i for i in range(len(old_table))]
    driver.run(swap_out=list(zip(old_table, cpu_blocks)), preempted_seq_ids=[1],
               cached_seqs=[driver.cached_seq(2)])
    assert torch.equal(bits(cache.cpu_k[:, cpu_blocks]), pages[0])
    assert torch.equal(bits(cache.cpu_v[:, cpu_blocks]), pages[1])
    cache.gpu_k[:, old_table] = float("nan")  # the pages must come back from the swap space
    cache.gpu_v[:, old_table] = float("nan")
    driver.run(cached_seqs=[driver.cached_seq(2)])
    new_table = [driver.free.pop() for _ in old_table]
    driver.tables[1] = list(new_table)
    driver.run(swap_in=list(zip(cpu_blocks, new_table)),
               new_seqs=[driver.new_seq(1, driver.tokens[1], 1,
                                        num_computed=len(driver.tokens[1]) - 1)],
               cached_seqs=[driver.cached_seq(2)])
    assert torch.equal(bits(cache.gpu_k[:, new_table[:-1]]), pages[0][:, :-1])
    decode_until(driver, prompts, 8)
    hf = fp8_reference("tiny", SCALES)
    for seq_id, prompt in prompts.items():
        new = driver.tokens[seq_id][len(prompt):]
        assert new == hf_greedy(hf, prompt, len(new)), seq_id


def test_a_copy_on_write_fork_of_fp8_pages_decodes_like_its_parent():
    runner = make_runner("tiny", SCALES)
    driver = PlanDriver(runner)
    prompt = random_prompt(random.Random(23), 10)
    driver.run(new_seqs=[driver.new_seq(1, prompt)])
    parent_last, child_last = fork_on_write(driver, 1, 2)
    k = runner.cache_engine.gpu_k
    assert torch.equal(bits(k[:, child_last, :, :2]), bits(k[:, parent_last, :, :2]))
    for _ in range(5):
        driver.run(cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    assert driver.tokens[2] == driver.tokens[1]
    hf = fp8_reference("tiny", SCALES)
    assert driver.tokens[1][len(prompt):] == hf_greedy(hf, prompt, len(driver.tokens[1]) - 10)


def shared_prompt_run(caching: bool):
    """16 requests sharing a 13-token prompt through the real scheduler, on an FP8 cache."""
    runner = make_runner("tiny", SCALES, num_gpu_blocks=40, num_cpu_blocks=0)
    sched = caching_scheduler(runner, caching, max_num_batched_tokens=32, max_num_seqs=8)
    rng = random.Random(24)
    system = random_prompt(rng, 13)
    for seq_id in range(1, 17):
        sched.add_seq(greedy_seq(seq_id, system + random_prompt(rng, rng.randint(1, 4)), 6))
    run = ScheduledRun(sched, RunnerLink(runner, overlap=True)).run()
    assert_pools_whole(sched)
    return run, sched


def test_prefix_cache_hits_on_fp8_pages_give_the_same_tokens():
    plain, _ = shared_prompt_run(False)
    cached, sched = shared_prompt_run(True)
    assert sched.stats().num_prefix_cache_hits >= 12 * 3  # most requests reuse 3 pages
    assert cached.outputs == plain.outputs


# -- scales from checkpoints, the CUDA refusal, Describe and the fingerprint ---------------------

def scales_of(tensors: dict, num_layers: int = 2) -> list[tuple[float, float]]:
    scales = kv_cache_scales(tensors.get, num_layers)
    return [(scales[f"model.layers.{i}.self_attn.attn.k_scale"].item(),
             scales[f"model.layers.{i}.self_attn.attn.v_scale"].item()) for i in range(num_layers)]


def test_checkpoint_scales_follow_vllms_names_and_rules():
    p0, p1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    t = torch.tensor
    # llm-compressor's kv_cache_scheme; neither: 1.0 (vLLM's default)
    assert scales_of({p0 + "k_scale": t(0.5), p0 + "v_scale": t([0.25])}) == [(0.5, 0.25),
                                                                             (1.0, 1.0)]
    # ModelOpt's names, k_proj / v_proj output scales, and the deprecated kv_scale for both
    assert scales_of({p0 + "k_proj.k_scale": t(0.5), p0 + "v_proj.v_scale": t(2.0),
                      p1 + "kv_scale": t(0.125)}) == [(0.5, 2.0), (0.125, 0.125)]
    assert scales_of({p0 + "k_proj.output_scale": t([0.5]), p0 + "v_proj.output_scale": t(4.0),
                      p1 + "v_scale": t(3.0)}) == [(0.5, 4.0), (3.0, 3.0)]  # one: for both
    for bad, why in ((t([0.5, 0.25]), "one float scale per layer"), (t(0.0), "positive"),
                     (t(float("nan")), "positive and finite")):
        with pytest.raises(QuantizationError, match=why) as err:
            scales_of({p1 + "k_scale": bad})
        assert str(err.value).startswith("model.layers.1.self_attn.k_scale is ")


def test_a_kv_cache_scheme_is_checked_as_vllm_does():
    group = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "dynamic": True}}
    qc = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group},
          "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                              "dynamic": False, "symmetric": True}}
    assert parse_quantization_config(qc).kv_cache_scales
    assert not parse_quantization_config({"quant_method": "gptq", "bits": 4,
                                          "group_size": 128}).kv_cache_scales
    qc["kv_cache_scheme"]["strategy"] = "channel"
    with pytest.raises(QuantizationError, match="kv_cache_scheme strategy 'channel'"):
        parse_quantization_config(qc)


def test_the_cuda_backend_takes_an_fp8_cache():
    CudaBackend.check_kv_cache_dtype(FP8)
    CudaBackend.check_kv_cache_dtype(torch.bfloat16)


def test_an_fp8_page_is_half_a_16_bit_one():
    shape = (30, 8, 16, 128)  # layers, kv heads, block size, head dim (Llama-3-8B's)
    assert bytes_per_block(*shape[:3], shape[3], FP8) * 2 == bytes_per_block(
        shape[0], shape[1], shape[3], shape[2], torch.bfloat16)


def test_the_fingerprint_tells_kv_cache_dtypes_apart():
    config = ModelConfig.from_hf_config(build_hf_model("tiny").config)
    identity = {"source": "preset:tiny", "tokenizer": ""}
    dense = model_fingerprint(config, identity)
    assert model_fingerprint(config, identity, kv_cache_dtype="fp8_e4m3") != dense
    assert model_fingerprint(config, identity, kv_cache_dtype=None) == dense


def test_describe_carries_quantization_and_kv_cache_dtype():
    info = ExecutorInfo("m", "fp", "bfloat16", 16, 100, 10, 512, 1000, "", "cuda",
                        quantization="gptq int4 g128 act-order", kv_cache_dtype="fp8_e4m3")
    described = scheduler_wire.description_from_proto(executor_wire.info_to_proto(info, 7))
    assert (described.quantization, described.kv_cache_dtype) == ("gptq int4 g128 act-order",
                                                                  "fp8_e4m3")
    # An executor built before the fields sends neither: dense weights, a cache of its dtype
    old = executor_wire.info_to_proto(info, 7)
    old.ClearField("quantization")
    old.ClearField("kv_cache_dtype")
    described = scheduler_wire.description_from_proto(old)
    assert (described.quantization, described.kv_cache_dtype) == ("", "bfloat16")


def add_tensors(folder, tensors: dict) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})


def test_an_fp8_folders_kv_scales_load_in_float32(tmp_path):
    """An fp8 folder's self_attn.k_scale / v_scale (what llm-compressor's kv_cache_scheme and
    fp8 tools write) become the layers' scales unrounded, even for a bfloat16 model; a gptq
    folder's are not read (vLLM gives awq and gptq no KV cache method): 1.0."""
    from executor_svc.config import ExecutorConfig
    from executor_svc.model_loader import load_model
    from executor_svc.worker import Worker
    from tests.executor_svc.quant_checkpoints import write_base, write_fp8, write_int4

    base = write_base(tmp_path / "base", "llama")
    write_fp8(base, tmp_path / "fp8", static=False)
    write_int4(base, tmp_path / "gptq", "gptq", 64)
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.0123456),
              "model.layers.0.self_attn.v_scale": torch.tensor(0.0234567),
              "model.layers.1.self_attn.kv_scale": torch.tensor(0.0345678)}
    for folder in ("fp8", "gptq"):
        add_tensors(tmp_path / folder, scales)
    worker = Worker(ExecutorConfig(model=str(tmp_path / "fp8"), backend="cpu", dtype="bfloat16",
                                   kv_cache_dtype="fp8", num_gpu_blocks=32))
    assert (worker.info.quantization, worker.info.kv_cache_dtype) == ("fp8 w8a8 dynamic",
                                                                      "fp8_e4m3")
    loaded = [(k.dtype, k.item(), v.item()) for k, v in worker.model.kv_scales]
    expected = [torch.tensor([0.0123456, 0.0234567]), torch.tensor([0.0345678] * 2)]
    assert loaded == [(torch.float32, *e.tolist()) for e in expected]
    gptq = load_model(str(tmp_path / "gptq"), torch.float32)[0]
    assert [(k.item(), v.item()) for k, v in gptq.kv_scales] == [(1.0, 1.0)] * 2


def test_the_flag_takes_vllms_values_and_a_bad_environment_value_is_named(monkeypatch, capsys):
    from executor_svc.main import parse_config

    assert parse_config(["--kv-cache-dtype", "fp8"])[0].resolved_kv_cache_dtype() == "fp8_e4m3"
    assert parse_config([])[0].kv_cache_dtype == "auto"
    monkeypatch.setenv("PAGEDSERVE_EXECUTOR_KV_CACHE_DTYPE", "fp8_e5m2")
    with pytest.raises(SystemExit):
        parse_config([])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pagedserve-executor: error: PAGEDSERVE_EXECUTOR_KV_CACHE_DTYPE='fp8_e5m2' is not one of "
        "auto, fp8, fp8_e4m3 (it sets --kv-cache-dtype)")
