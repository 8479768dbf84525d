"""--kv-cache-dtype fp8 on the CUDA backend: a small random bf16 model whose FP8 cache (e4m3,
calibrated per-layer scales) our prefill, few-query and decode kernels read, decode graphs
replayed, within compare_bf16_with_transformers' measured tolerance of the CPU backend's FP8 twin
in bf16 (the float32 twin, same cache and scales, measuring bf16's own error); the worker serving
a bf16 checkpoint with it: twice the pages of a 16-bit cache in the same memory, greedy tokens the
twin's until a near-tie."""
from __future__ import annotations

import functools
import gc
import random

import pytest
import torch

from executor_svc.backends.cuda import CudaBackend
from executor_svc.config import ExecutorConfig
from executor_svc.model_loader import load_model
from executor_svc.model_runner import ModelRunner
from pagedserve_kernels import _compile
from pagedserve_kernels.reference import KV_FP8
from tests.executor_svc.helpers import (Bf16Reference, PlanDriver,
                                        compare_bf16_with_transformers, decode_all,
                                        loaded_runner, teacher_forced)
from tests.executor_svc.quant_checkpoints import VOCAB, write_base
from tests.gpu import gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]

# head_dim 64, 4 query heads over 2 KV heads, 2 layers; weights drawn at 0.1 (test_quantized_gpu's
# shape: at 0.3 attention is near-argmax and bf16 too chaotic for the tolerance to mean much)
SHAPE = dict(hidden_size=256, intermediate_size=1024, initializer_range=0.1)
# (k_scale, v_scale) per layer near amax / 448 of this model's K and V (about 6), as a calibrated
# checkpoint's; the worker's test serves scales 1.0, vLLM's default for a checkpoint without any
SCALES = [(0.0137, 0.0119), (0.0161, 0.0143)]
ONES = [(1.0, 1.0), (1.0, 1.0)]
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, NUM_NEW = 16, 512, 256, 24
# The prompts' step: 246 rows (the prefill kernel), or 52 (the few-query kernel)
LENGTHS = {"prefill": (37, 80, 129), "few_query": (5, 17, 30)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_base(tmp_path_factory.mktemp("llama"), "llama", **SHAPE)


@functools.lru_cache(maxsize=None)
def cuda_backend() -> CudaBackend:
    return CudaBackend()


def load(path, dtype_name: str, backend=None, scales=SCALES):
    """(model, config, backend): the folder on the CPU backend (None) or `backend`, with the
    layers' KV scales set as the loader sets a checkpoint's."""
    if backend is None:
        model, config, _, _ = load_model(str(path), dtype_name)
    else:
        model, config, _, _ = load_model(str(path), dtype_name, backend.device, 0, backend)
    device = model.embed_tokens.device
    model.kv_scales = [(torch.tensor(k, device=device), torch.tensor(v, device=device))
                       for k, v in scales]
    return model, config, model.backend


def fp8_runner(model, config, backend, dtype_name: str, graphs: bool = False) -> ModelRunner:
    """A runner on an FP8 cache of NUM_BLOCKS pages; `graphs`: the decode ladder captured,
    every step sampled eagerly (so a RecordingSampler sees the logits)."""
    return loaded_runner(model, config, backend, dtype_name, BLOCK_SIZE, NUM_BLOCKS,
                         MAX_MODEL_LEN, "fp8_e4m3", graphs)


def prompts(lengths) -> dict[int, list[int]]:
    rng = random.Random(29)
    return {s: [rng.randrange(3, VOCAB) for _ in range(n)] for s, n in enumerate(lengths, 1)}


def twin_reference(path, lengths, device, scales=SCALES) -> Bf16Reference:
    """The CPU backend's FP8 twin in bf16: its greedy tokens for prompts(lengths) and its
    teacher-forced logits on them, and the float32 twin's on the same tokens."""
    asked = prompts(lengths)
    twin = fp8_runner(*load(path, "bfloat16", scales=scales), "bfloat16")
    driver = PlanDriver(twin)
    decode_all(driver, asked, NUM_NEW)
    tokens = {s: driver.tokens[s][len(p):len(p) + NUM_NEW] for s, p in asked.items()}
    twin.reset()
    ref = Bf16Reference(asked, tokens, {}, {})
    fp32 = fp8_runner(*load(path, "float32", scales=scales), "float32")
    return Bf16Reference(asked, tokens, teacher_forced(twin, ref, device),
                         teacher_forced(fp32, ref, device))


def spy_on_launches(monkeypatch) -> list[str]:
    """The kernels launched eagerly from here on (graph replays launch nothing)."""
    launched, launch = [], _compile.launch

    def spy(module, kernel, *args, **kwargs):
        launched.append(kernel)
        return launch(module, kernel, *args, **kwargs)
    monkeypatch.setattr(_compile, "launch", spy)
    return launched


@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_fp8_kv_cache_on_the_gpu_within_tolerance_of_its_twin(base, lengths, monkeypatch):
    """Ours (the FP8 kernels: fused RoPE and cache write, prefill or few-query, decode graphs
    replayed) by compare_bf16_with_transformers' rule against the CPU backend's FP8 twin; no
    16-bit-cache attention kernel runs."""
    backend = cuda_backend()
    twin = twin_reference(base, LENGTHS[lengths], backend.device)
    launched = spy_on_launches(monkeypatch)
    runner = fp8_runner(*load(base, "bfloat16", backend), "bfloat16", graphs=True)
    assert runner.cache_engine.kv_caches[0].dtype == KV_FP8
    within, identical = compare_bf16_with_transformers(runner, twin, f"fp8 kv cache {lengths}")
    del runner, twin
    torch.cuda.empty_cache()
    kernels = set(launched)
    first = "prefill_wg_bf16_hd64_fp8" if lengths == "prefill" else "decode_mq_bf16_hd64_fp8"
    print(f"kernels launched eagerly: {sorted(kernels)}")
    assert "decode_bf16_hd64_fp8" in kernels
    assert first in kernels or (lengths == "prefill" and "prefill_bf16_hd64_fp8" in kernels)
    assert any(k.startswith("rotary_embedding_cache_bf16") and k.endswith("_fp8") for k in kernels)
    assert not kernels & {"decode_bf16_hd64", "decode_mq_bf16_hd64", "prefill_bf16_hd64",
                          "prefill_wg_bf16_hd64"}
    assert all(within.values()), within
    assert all(identical.values()), identical


def test_the_worker_serves_an_fp8_cache_of_twice_the_pages(base):
    """What the executor runs with --kv-cache-dtype fp8 on a bf16 checkpoint (scales 1.0): memory
    profile, decode and small-step graphs sampling in the graph, warm-up. Twice the pages of
    --kv-cache-dtype auto at the same --gpu-memory-utilization (within 2%: the profile's
    measurements); greedy tokens the twin's until its top-2 margin is within twice the largest
    logit difference a runner of ours showed at that position."""
    from executor_svc.worker import Worker

    backend = cuda_backend()
    twin = twin_reference(base, LENGTHS["prefill"], backend.device, scales=ONES)
    ours = teacher_forced(fp8_runner(*load(base, "bfloat16", backend, ONES), "bfloat16",
                                     graphs=True), twin, backend.device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free + 3 * 2**30) / total

    def worker(kv_cache_dtype: str) -> Worker:
        return Worker(ExecutorConfig(model=str(base), backend="cuda", dtype="bfloat16",
                                     kv_cache_dtype=kv_cache_dtype, max_model_len=MAX_MODEL_LEN,
                                     max_num_batched_tokens=512,
                                     gpu_memory_utilization=utilization, swap_space_gib=0.01))

    fp8 = worker("fp8")
    assert fp8.info.kv_cache_dtype == "fp8_e4m3"
    assert fp8.cache_engine.kv_caches[0].dtype == KV_FP8
    assert fp8.step_limits.decode_graph_sizes and fp8.step_limits.small_step_graph_sizes
    driver = PlanDriver(fp8.runner)
    decode_all(driver, twin.prompts, NUM_NEW)
    tokens = {s: driver.tokens[s][len(p):len(p) + NUM_NEW] for s, p in twin.prompts.items()}
    fp8_pages = fp8.info.num_gpu_blocks
    del fp8, driver
    gc.collect()
    torch.cuda.empty_cache()
    auto = worker("auto")
    auto_pages = auto.info.num_gpu_blocks
    del auto
    gc.collect()
    torch.cuda.empty_cache()
    print(f"KV pages at utilization {utilization:.3f}: fp8 {fp8_pages}, auto {auto_pages}")
    assert abs(fp8_pages - 2 * auto_pages) <= 0.02 * fp8_pages
    for s, prompt in twin.prompts.items():
        tolerance = (ours[s] - twin.logits[s]).abs().max(dim=-1).values
        top2 = twin.logits[s].topk(2, dim=-1).values
        near_tie = ((top2[:, 0] - top2[:, 1]) <= 2 * tolerance).nonzero()
        stop = int(near_tie[0]) if len(near_tie) else NUM_NEW
        print(f"worker seq {s}: identical through {stop}/{NUM_NEW} required")
        assert tokens[s][:stop] == twin.tokens[s][:stop], s
