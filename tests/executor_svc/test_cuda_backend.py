"""The CUDA executor path: decode-graph input packing (also on CPU, replayed eagerly), and on the
GPU: tiny float32 greedy identical to transformers, bf16 SmolLM2/Llama-3-8B shapes within bf16
tolerance of transformers (teacher-forced logits through graph replays, then free-running greedy
tokens up to the first near-tie), sampling and overlapped step launches without host syncs,
overlapped steps giving the same outputs as one step at a time, and the worker's memory
profile."""
from __future__ import annotations

import dataclasses
import functools
import gc
import random

import numpy as np
import pytest
import torch

from executor_svc.cache_engine import CacheEngine
from executor_svc.cuda_graphs import BATCH_SIZES, TOKEN_SIZES, CudaGraphs
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import build_hf_model, model_from_hf
from executor_svc.model_runner import ModelRunner
from executor_svc.sampler import Sampler, SamplingTensors
from executor_svc.step import CachedSeqs, ExecutorInfo, SamplingOptions, StepPlan
from tests.executor_svc.helpers import (
    assert_same_results,
    PlanDriver, RunnerLink, ScheduledRun, add_workload, bf16_reference,
    compare_bf16_with_transformers, decode_all, execute, hf_generate, hf_greedy,
    hf_model, make_runner, make_scheduler, random_prompt, spy_on_graph_sampling,
    with_eager_graphs,
)
from tests.gpu import gpu_ready


BLOCK_SIZE = 16


# -- CPU: the graph runner's packing and padding, with replays run eagerly ----------------------

def test_decode_graph_inputs_replayed_eagerly_match_transformers():
    hf = hf_model("tiny")
    runner = with_eager_graphs(make_runner(hf))
    rng = random.Random(20)
    prompts = {s: random_prompt(rng, n) for s, n in zip(range(1, 6), (3, 9, 14, 1, 6))}
    driver = PlanDriver(runner)
    decode_all(driver, prompts, 8)  # 5 seqs padded to 8, then fewer as they finish
    for seq_id, prompt in prompts.items():
        assert driver.tokens[seq_id][len(prompt):len(prompt) + 8] == hf_greedy(hf, prompt, 8)


# -- GPU ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _backend():
    from executor_svc.backends import get_backend

    return get_backend("cuda")


def gpu_runner(hf, dtype_name: str, num_gpu_blocks: int = 512, num_cpu_blocks: int = 16,
               max_model_len: int = 1024, graphs: bool = True,
               small_graphs: bool = False, lt_rows: list[int] | None = None,
               **graph_options) -> ModelRunner:
    """graph_options go to CudaGraphs (e.g. sample_in_graphs=False); `graphs`: the decode ladder,
    `small_graphs`: the small-step one. lt_rows: every product of
    these row counts runs a cuBLASLt algorithm (pagedserve_kernels.gemm, the fastest even where
    F.linear is faster), in this runner's backend."""
    backend = _backend()
    config = ModelConfig.from_hf_config(hf.config)
    model = model_from_hf(hf, config, backend)
    if lt_rows:
        backend.tune_linears(model.linear_groups(), lt_rows, force_lt=True)
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE,
                        num_gpu_blocks, num_cpu_blocks, model.embed_tokens.dtype, backend)
    info = ExecutorInfo("test", "fp", dtype_name, BLOCK_SIZE, num_gpu_blocks, num_cpu_blocks,
                        max_model_len, config.vocab_size, "", "cuda")
    cuda_graphs = None
    if graphs or small_graphs:
        graph_options.setdefault("batch_sizes", BATCH_SIZES if graphs else ())
        cuda_graphs = CudaGraphs(model, cache.kv_caches, max_model_len // BLOCK_SIZE,
                                 token_sizes=TOKEN_SIZES if small_graphs else (), **graph_options)
    runner = ModelRunner(model, backend, cache, info, cuda_graphs)
    if cuda_graphs is not None:
        cuda_graphs.capture(runner.input_batch.token_counts)
    return runner


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama3"])
def test_tiny_float32_greedy_identical_to_transformers_on_gpu(preset):
    hf = build_hf_model(preset, seed=0, dtype=torch.float32, device="cuda")
    runner = gpu_runner(hf, "float32")
    rng = random.Random(30)
    prompts = {s: random_prompt(rng, n) for s, n in zip(range(1, 5), (5, 17, 40, 1))}
    driver = PlanDriver(runner)
    decode_all(driver, prompts, 32)
    for seq_id, prompt in prompts.items():
        assert driver.tokens[seq_id][len(prompt):len(prompt) + 32] == hf_generate(hf, prompt, 32)


NUM_NEW = 24


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("preset", ["smollm2-135m", "llama3-8b"])
def test_bf16_logits_within_tolerance_and_greedy_until_near_tie(preset):
    """The bf16 rule of helpers.compare_bf16_with_transformers (tolerance measured against
    transformers' own bf16-vs-float32 distance), with every product on a cuBLASLt algorithm."""
    hf = build_hf_model(preset, seed=0, dtype=torch.bfloat16, device="cuda")
    vocab = hf.config.vocab_size
    rng = random.Random(40)
    prompts = {s: random_prompt(rng, n, vocab) for s, n in zip(range(1, 4), (37, 80, 129))}
    ref = bf16_reference(hf, prompts, NUM_NEW)
    torch.cuda.empty_cache()
    # The recorder sees the logits; every product runs a cuBLASLt algorithm (prefill: 246 rows,
    # decode graph: 4, sampled rows: 3), as a tuned executor's may.
    runner = gpu_runner(hf, "bfloat16", sample_in_graphs=False, lt_rows=[3, 4, 246])
    algos = runner.model.backend.gemm.algos
    assert all((4, *group[0].shape, torch.bfloat16) in algos
               for group in runner.model.linear_groups().values())  # the decode graph's
    within, identical = compare_bf16_with_transformers(runner, ref, preset)
    del runner, hf, ref
    torch.cuda.empty_cache()
    assert all(within.values()), within
    assert all(identical.values()), identical


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_sampling_on_gpu_has_no_host_sync_and_matches_cpu():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    options = [SamplingOptions(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=i % 5)
               if i % 3 else SamplingOptions() for i in range(64)]
    positions = list(range(100, 164))
    cpu = Sampler()(logits, options, positions)
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        params = SamplingTensors.build(options, positions, 1000, gpu_logits.device)
        token_ids, logprobs = Sampler().sample(gpu_logits, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert token_ids.tolist() == cpu[0]  # same counter-based draws on both devices
    torch.testing.assert_close(logprobs.cpu(), torch.tensor(cpu[1]), rtol=1e-4, atol=1e-4)


_VARIANT_OPTIONS = {
    "greedy": SamplingOptions(),
    "sampled": SamplingOptions(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=3),
    "controlled": SamplingOptions(temperature=0.8, top_p=0.9, seed=4, repetition_penalty=1.2,
                                  presence_penalty=0.5, frequency_penalty=0.2,
                                  logit_bias=((5, 2.0), (9, -3.0)), logprobs=20),
}


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("variant", list(_VARIANT_OPTIONS))
def test_decode_step_has_no_host_sync(variant):
    """A whole decode step's launch (packing, the one copy, the replay of forward + sampling,
    the results' copy to the host queued) syncs nothing, for each graph variant; the graph
    sampled the step (issue 13)."""
    hf = build_hf_model("smollm2-135m", seed=0, dtype=torch.bfloat16, device="cuda")
    runner = gpu_runner(hf, "bfloat16", max_model_len=512)
    sampled_in_graph = spy_on_graph_sampling(runner)
    driver = PlanDriver(runner)
    prompts = {1: list(range(5, 40)), 2: list(range(7, 20))}
    options = _VARIANT_OPTIONS[variant]
    driver.run(new_seqs=[driver.new_seq(s, p, sampling=options) for s, p in prompts.items()])
    step = driver.plan(cached_seqs=[driver.cached_seq(s) for s in prompts])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = runner.launch(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.kind == "decode" and sampled_in_graph == [True]
    out = runner.finish(pending)
    assert [t.seq_id for t in out.sampled] == [1, 2]
    del runner, hf
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("max_controlled_batch", [16, 2])
def test_graph_sampling_matches_the_eager_sampler_on_gpu(max_controlled_batch):
    """Eight seqs of every kind (greedy, seeded samples, penalties, logit bias, top logprobs)
    decoding to different lengths, float32: graphs that sample against the same graphs whose
    logits the eager Sampler samples (sample_in_graphs=False): the same tokens and top ids,
    logprobs within float32 rounding. With max_controlled_batch=2 the larger controlled
    batches fall back to the eager Sampler (issue 13)."""
    hf = build_hf_model("tiny", seed=0, dtype=torch.float32, device="cuda")
    kinds = list(_VARIANT_OPTIONS.values())
    options = [kinds[i % 3] for i in range(6)] + [
        SamplingOptions(logit_bias=((17, 4.0),), logprobs=3),
        SamplingOptions(frequency_penalty=-1.0, presence_penalty=0.5)]
    options = [dataclasses.replace(o, seed=o.seed + i) for i, o in enumerate(options)]
    num_new = [20, 7, 16, 11, 24, 5, 13, 18]
    rng = random.Random(33)
    prompts = {i: random_prompt(rng, 3 + 2 * i, hf.config.vocab_size) for i in range(8)}
    runs = {}
    for in_graphs in (True, False):
        runner = gpu_runner(hf, "float32", batch_sizes=(1, 2, 4, 8, 16),
                            sample_in_graphs=in_graphs, max_controlled_batch=max_controlled_batch)
        driver = PlanDriver(runner)
        sampled = []
        fields = {"new_seqs": [driver.new_seq(i, p, sampling=options[i])
                               for i, p in prompts.items()]}
        while fields:
            for t in execute(runner, driver.plan(**fields)).sampled:
                driver.tokens[t.seq_id].append(t.token_id)
                sampled.append(t)
            left = [i for i in prompts if len(driver.tokens[i]) - len(prompts[i]) < num_new[i]]
            fields = {"cached_seqs": [driver.cached_seq(i) for i in left]} if left else None
        runs[in_graphs] = sampled
        del runner
        torch.cuda.empty_cache()
    for a, b in zip(runs[True], runs[False], strict=True):
        assert (a.seq_id, a.token_id, a.top_token_ids) == (b.seq_id, b.token_id, b.top_token_ids)
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is not None:
            assert abs(a.logprob - b.logprob) < 1e-5
            np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_overlapped_decode_launch_has_no_host_sync():
    """Step 3 launched while step 2 is unfinished: its input ids come from step 2's sampled ids
    on the device, and nothing in the launch waits for the GPU."""
    hf = build_hf_model("smollm2-135m", seed=0, dtype=torch.bfloat16, device="cuda")
    runner = gpu_runner(hf, "bfloat16", max_model_len=512)
    driver = PlanDriver(runner)
    prompts = {1: list(range(5, 40)), 2: list(range(7, 20))}
    prefill = runner.launch(
        StepPlan(1, new_seqs=[driver.new_seq(s, p) for s, p in prompts.items()]))
    first = runner.launch(StepPlan(2, cached_seqs=CachedSeqs.of((s, 1, len(p), [])
                                                                for s, p in prompts.items())))
    runner.finish(prefill)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = runner.launch(StepPlan(3, cached_seqs=CachedSeqs.of(
            (s, 1, len(p) + 1, []) for s, p in prompts.items())))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert second.kind == "decode"
    outputs = runner.finish(first), runner.finish(second)
    assert [[t.seq_id for t in out.sampled] for out in outputs] == [[1, 2], [1, 2]]
    del runner, hf
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_an_eager_step_of_new_row_counts_launches_while_the_gpu_is_busy():
    """An eager step's launch returns while earlier GPU work still runs, though its token count
    and sampled rows were never seen (products between or past the tuned row counts run their
    rung: pagedserve_kernels/gemm.py); the step's tokens are those of the same step launched on an
    idle GPU. Before rungs, a W1 prefill step's launch waited ~140 ms in the lm_head product."""
    hf = build_hf_model("smollm2-135m", seed=0, dtype=torch.bfloat16, device="cuda")
    runner = gpu_runner(hf, "bfloat16", max_model_len=1024, graphs=False, lt_rows=[8, 64, 512])
    rng = random.Random(11)
    prompts = {s: random_prompt(rng, n) for s, n in zip(range(1, 6), (113, 291, 77, 9, 640))}

    def step(driver):  # 1,130 prompt tokens and 5 sampled rows: neither tuned
        return StepPlan(driver.step_id + 1, new_seqs=[driver.new_seq(s, p)
                                                      for s, p in prompts.items()])

    driver = PlanDriver(runner)
    driver.run(new_seqs=[driver.new_seq(9, random_prompt(rng, 40))])  # loads our own kernels
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued first
    busy = torch.cuda.Event()
    busy.record()
    pending = runner.launch(step(driver))
    assert not busy.query(), "the launch waited for the GPU"
    busy_tokens = runner.finish(pending).token_ids.tolist()
    runner.reset()
    driver = PlanDriver(runner)
    torch.cuda.synchronize()
    assert execute(runner, step(driver)).token_ids.tolist() == busy_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_overlapped_steps_match_one_step_at_a_time_on_gpu(graphs):
    """The real scheduler's plans, two in flight (chunked prefill, decode, swap, finished seqs,
    seeded samples): launching step N+1 before step N is finished gives the same tokens, and
    logprobs within float32 rounding, as finishing every step at once."""
    hf = build_hf_model("tiny", seed=0, dtype=torch.float32, device="cuda")
    runs = {}
    for overlap in (False, True):
        runner = gpu_runner(hf, "float32", num_gpu_blocks=6, num_cpu_blocks=16, graphs=graphs)
        sched = make_scheduler(runner.info, max_num_batched_tokens=16, max_num_seqs=6)
        add_workload(sched, seed=4, vocab=hf.config.vocab_size)
        link = RunnerLink(runner, overlap)
        runs[overlap] = ScheduledRun(sched, link).run()
    print(f"graphs={graphs}: {len(runs[True].results)} steps, {link.launched_with_pending} "
          f"launched with an unfinished step, {sched.num_preemptions_swap} swap preemptions")
    assert link.launched_with_pending > 0
    assert_same_results(runs[True], runs[False])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_worker_sizes_kv_cache_from_memory_and_pins_swap_space():
    from executor_svc.config import ExecutorConfig
    from executor_svc.step import NewSeq, StepPlan
    from executor_svc.worker import Worker

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free + 12 * 2**30) / total  # about 12 GiB beyond what is in use now
    worker = Worker(ExecutorConfig(model="preset:smollm2-135m", backend="cuda",
                                   gpu_memory_utilization=utilization, swap_space_gib=0.25))
    info, profile = worker.info, worker.memory_profile
    assert info.backend == "cuda" and info.dtype == "bfloat16"
    assert info.num_gpu_blocks == profile.num_gpu_blocks > 1000
    assert info.num_cpu_blocks == int(0.25 * 2**30) // worker.cache_engine.bytes_per_block()
    assert worker.cache_engine.cpu_k.is_pinned() and worker.cache_engine.cpu_v.is_pinned()
    kv_bytes = info.num_gpu_blocks * worker.cache_engine.bytes_per_block()
    assert kv_bytes <= total * utilization - profile.used_after_weights
    out = execute(worker.runner, StepPlan(1, new_seqs=[NewSeq(1, [1, 2, 3], [0], 0, 3)]))
    assert [s.seq_id for s in out.sampled] == [1] and out.step_ms > 0
    del worker
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("preset,num_layers", [("smollm2-135m", None), ("llama3-8b", 2)])
def test_mixed_step_split_matches_the_prefill_kernel_alone(preset, num_layers):
    """A mixed step's leading decodes go to the decode kernel (head_dim 64 and 128), its chunks
    to the prefill kernel; the same step with every seq through the prefill kernel (the path
    before the split) gives the same hidden states up to bf16 rounding. The 8B shape keeps two
    layers: random 32-layer nets amplify rounding differences to ~5% (measured), which would
    hide a real error."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from executor_svc.attention_metadata import build_attention_metadata
    from executor_svc.backends import get_backend
    from executor_svc.model_config import preset_hf_config

    hf_config = preset_hf_config(preset)
    hf_config.num_hidden_layers = num_layers or hf_config.num_hidden_layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    config = ModelConfig.from_hf_config(hf.config)
    backend = get_backend("cuda")
    model = model_from_hf(hf, config, backend)
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, 512,
                        1, torch.bfloat16, backend)
    rng = random.Random(41)
    lengths = [rng.randint(20, 300) for _ in range(12)] + [700, 90]
    tables = [rng.sample(range(512), -(-n // BLOCK_SIZE)) for n in lengths]
    computed = [n - 1 for n in lengths[:12]] + [300, 0]  # 12 decodes, a chunk, a new prompt
    scheduled = [1] * 12 + [400, 90]
    ids = torch.tensor([rng.randrange(1, config.vocab_size) for _ in range(sum(scheduled))],
                       device="cuda")
    prefix = [(t, c) for t, c in zip(tables, computed) if c]  # the cached context, first
    positions, md = build_attention_metadata([t for t, _ in prefix], [0] * len(prefix),
                                             [c for _, c in prefix], BLOCK_SIZE, "cuda")
    context = torch.randint(1, config.vocab_size, (sum(c for _, c in prefix),), device="cuda")
    model.forward(context, positions, md, cache.kv_caches)
    positions, md = build_attention_metadata(tables, computed, scheduled, BLOCK_SIZE, "cuda")
    assert md.num_decodes == 12 and md.prefill is not None
    split = model.forward(ids, positions, md, cache.kv_caches).float()
    unsplit_md = dataclasses.replace(md, num_decodes=0, prefill=None)
    unsplit = model.forward(ids, positions, unsplit_md, cache.kv_caches).float()
    rel = ((split - unsplit).norm(dim=-1) / unsplit.norm(dim=-1))  # per token
    print(f"{preset}: split vs prefill-only, relative difference max {rel.max():.4f} "
          f"mean {rel.mean():.4f}")
    assert rel.max() < 0.03 and rel.mean() < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_small_step_graphs_match_the_eager_forward_on_gpu():
    """Steps with prompt tokens replayed from the small-step graphs give the eager forward's
    distribution (bf16, which the kernels cover; one-token seqs go through the graph's prefill
    attention, the decode kernel eagerly, hence a tolerance), and a graph step's launch syncs
    nothing: a prefill of three seqs (62 tokens), a mixed step of their decodes and a new prompt
    (33), a 400-token chunk of a 412-token prompt (512-token graph), then its last 12 tokens
    over the 400 cached beside four decodes (16 tokens). Steps of up to FEW_QUERY_MAX tokens
    take the few-query kernel (each seq's query tokens sharing one read of its context), the
    512-token one the prefill kernel."""
    hf = build_hf_model("smollm2-135m", seed=0, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(3)
    prompts = {1: random_prompt(rng, 5), 2: random_prompt(rng, 17), 3: random_prompt(rng, 40)}
    late, long = random_prompt(rng, 30), random_prompt(rng, 412)
    top = SamplingOptions(logprobs=5)
    outputs = {}
    for small in (False, True):
        runner = gpu_runner(hf, "bfloat16", max_model_len=512, small_graphs=small)
        replayed = []
        if small:
            assert runner.backend.few_query_max >= 16
            real_run = runner.graphs.run

            def counting_run(inputs, sampling=None, *args):
                if not inputs.is_decode:
                    replayed.append(len(inputs.input_ids))
                return real_run(inputs, sampling, *args)
            runner.graphs.run = counting_run
        driver = PlanDriver(runner)
        steps = [
            lambda: dict(new_seqs=[driver.new_seq(s, p, sampling=top) for s, p in prompts.items()]),
            lambda: dict(cached_seqs=CachedSeqs.of(driver.cached_seq(s) for s in prompts),
                         new_seqs=[driver.new_seq(4, late, sampling=top)]),
            lambda: dict(new_seqs=[driver.new_seq(5, long, num_scheduled=400, sampling=top)]),
            lambda: dict(cached_seqs=CachedSeqs.of(
                [driver.cached_seq(s) for s in (1, 2, 3, 4)]
                + [driver.cached_seq(5, num_scheduled=12)])),
        ]
        outputs[small] = _run_steps(runner, driver, steps, outputs.get(False),
                                    lambda step_id: small)
        assert [len(o.sampled) for o in outputs[small]] == [3, 4, 0, 5]
        assert replayed == ([62, 33, 400, 16] if small else [])  # every step took the graphs
        del runner
        torch.cuda.empty_cache()
    _assert_same_distribution(outputs[False], outputs[True])


def _run_steps(runner, driver, steps, follow=None, checked=lambda step_id: False) -> list:
    """Launches and finishes each step (`steps`: functions giving a plan's fields) and returns
    their StepResults; the launches `checked` names must sync nothing. Each step's tokens are
    appended from `follow` (another run's results, so that both runs continue from the same
    tokens where a close call differs) or else its own."""
    outputs = []
    for step_id, fields in enumerate(steps, start=1):
        plan = StepPlan(step_id, **fields())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked(step_id) else "default")
        try:
            pending = runner.launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = runner.finish(pending)
        for t in (follow[step_id - 1] if follow is not None else out).sampled:
            driver.tokens[t.seq_id].append(t.token_id)
        outputs.append(out)
    return outputs


def _assert_same_distribution(eager: list, other: list) -> None:
    """Step by step, the same seqs sampled, top logprobs within bf16's tolerance, and the same
    token unless the eager run's top two were a close call."""
    for eager_step, other_step in zip(eager, other, strict=True):
        for a, b in zip(eager_step.sampled, other_step.sampled, strict=True):
            assert a.seq_id == b.seq_id
            torch.testing.assert_close(torch.tensor(b.top_logprobs), torch.tensor(a.top_logprobs),
                                       atol=0.05, rtol=0.0)
            close_call = a.top_logprobs[0] - a.top_logprobs[1] < 0.05
            assert a.token_id == b.token_id or close_call, (a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_no_garbage_collection_runs_inside_a_capture():
    """With a collector that runs at nearly every allocation, the executor's decode-graph
    captures (every ladder captures through the same graph_capture) see no collection start
    while a stream captures: one there may destroy a dead runner's graphs, which the driver
    refuses mid-capture, invalidating the capture. Its graphs then replay transformers' greedy
    tokens."""
    hf = build_hf_model("tiny", seed=0, dtype=torch.float32, device="cuda")
    inside = []

    def watch(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            inside.append(info["generation"])

    gc.collect()
    gc.freeze()  # what is alive now leaves the scans, so that frequent collections stay cheap
    threshold = gc.get_threshold()
    gc.set_threshold(1, *threshold[1:])
    gc.callbacks.append(watch)
    try:
        runner = gpu_runner(hf, "float32")
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
        gc.unfreeze()
    assert runner.graphs.graphs
    assert inside == []
    rng = random.Random(31)
    prompts = {s: random_prompt(rng, n) for s, n in zip(range(1, 4), (5, 17, 40))}
    driver = PlanDriver(runner)
    decode_all(driver, prompts, 16)
    for seq_id, prompt in prompts.items():
        assert driver.tokens[seq_id][len(prompt):len(prompt) + 16] == hf_generate(hf, prompt, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_piecewise_graphs_match_the_eager_forward_on_gpu():
    """Steps neither full-step ladder holds, replayed piecewise (attention eagerly between the
    captured pieces) give the eager forward's distribution in bf16 (the same kernels, the
    products up to 704 rows on cuBLASLt algorithms as a tuned executor's, the pieces' QKV
    product straight into their static buffer; products at the padded row count, hence a
    tolerance), and their launch syncs nothing: a prefill of 40 seqs (680 tokens, padded to
    704), then their 40 decodes beside a new 300-token prompt (340 tokens over 41 seqs: past
    the small-step graphs' 32), then 40 decodes beside that prompt's next 12 tokens (52 tokens,
    few-query attention), then a 1,100-token step past the ladder, eager."""
    hf = build_hf_model("smollm2-135m", seed=0, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(4)
    prompts = {s: random_prompt(rng, 17) for s in range(1, 41)}
    late, huge = random_prompt(rng, 312), random_prompt(rng, 1100)
    top = SamplingOptions(logprobs=5)
    outputs = {}
    for pieced in (False, True):
        runner = gpu_runner(hf, "bfloat16", max_model_len=2048, graphs=pieced, batch_sizes=(),
                            piece_sizes=BATCH_SIZES[BATCH_SIZES.index(16):],
                            lt_rows=[64, 384, 704])
        qkv = runner.model.layers[0].qkv_proj
        assert (704, *qkv.shape, torch.bfloat16) in runner.model.backend.gemm.algos
        replayed = []
        if pieced:
            pieces = runner.graphs.piecewise
            real_forward = pieces.forward

            def counting_forward(input_ids, positions, md):
                replayed.append(len(input_ids))
                return real_forward(input_ids, positions, md)
            pieces.forward = counting_forward
        driver = PlanDriver(runner)
        steps = [
            lambda: dict(new_seqs=[driver.new_seq(s, p, sampling=top) for s, p in prompts.items()]),
            lambda: dict(cached_seqs=CachedSeqs.of(driver.cached_seq(s) for s in prompts),
                         new_seqs=[driver.new_seq(41, late, num_scheduled=300, sampling=top)]),
            lambda: dict(cached_seqs=CachedSeqs.of(
                [driver.cached_seq(s) for s in prompts]
                + [driver.cached_seq(41, num_scheduled=12)])),
            lambda: dict(new_seqs=[driver.new_seq(42, huge, sampling=top)]),
        ]
        outputs[pieced] = _run_steps(runner, driver, steps, outputs.get(False),
                                     lambda step_id: pieced and step_id < 4)
        assert [len(o.sampled) for o in outputs[pieced]] == [40, 40, 41, 1]
        assert replayed == ([680, 340, 52] if pieced else [])  # the 1,100-token step: eager
        del runner
        torch.cuda.empty_cache()
    _assert_same_distribution(outputs[False], outputs[True])
