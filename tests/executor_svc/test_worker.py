"""Worker from an ExecutorConfig: its info and a step round trip through its runner, on a preset;
what it asks of the backend (the CPU's defaults, the CUDA backend's tuning rows and warm-up)."""
from types import SimpleNamespace

import pytest
import torch

from executor_svc.backends import get_backend
from executor_svc.backends.cuda import CudaBackend
from executor_svc.cuda_graphs import BATCH_SIZES
from executor_svc.config import ExecutorConfig
from executor_svc.step import CachedSeqs, NewSeq, SamplingOptions, StepPlan
from executor_svc.worker import Worker
from tests.executor_svc.helpers import execute


def test_worker_describe_and_execute():
    worker = Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=32, swap_space_gib=0.01))
    info, runner = worker.info, worker.runner
    assert runner.info is info
    assert (info.backend, info.dtype, info.block_size, info.num_gpu_blocks) == ("cpu", "float32", 16, 32)
    assert info.num_cpu_blocks == int(0.01 * 2**30) // worker.cache_engine.bytes_per_block()
    assert info.vocab_size == 49152 and info.max_model_len == 2048 and len(info.fingerprint) == 64
    out = execute(
        runner, StepPlan(1, new_seqs=[NewSeq(3, [1, 2, 3], [7], 0, 3, SamplingOptions())]))
    assert [s.seq_id for s in out.sampled] == [3] and out.step_ms >= out.forward_ms
    out = execute(runner, StepPlan(2, cached_seqs=CachedSeqs.of([(3, 1, 3, [])])))
    assert [s.seq_id for s in out.sampled] == [3]
    runner.reset()
    assert not len(runner.input_batch)


def test_fingerprint_depends_on_seed_and_preset():
    a = Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=4, swap_space_gib=0.001))
    b = Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=8, swap_space_gib=0.001, seed=1))
    c = Worker(ExecutorConfig(model="preset:tiny-qwen2", num_gpu_blocks=4, swap_space_gib=0.001))
    assert len({a.info.fingerprint, b.info.fingerprint, c.info.fingerprint}) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine builds the backend")
def test_cuda_backend_fails_loudly_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA device"):
        get_backend("cuda")


def test_the_cpu_backend_leaves_the_worker_its_defaults():
    worker = Worker(ExecutorConfig(model="preset:tiny", swap_space_gib=0.001))
    assert worker.memory_profile is None and worker.info.num_gpu_blocks == 1024
    assert worker.runner.graphs is None


def test_cuda_prepare_model_tunes_graph_batches_then_step_rungs():
    """The rows CudaBackend tunes (no GPU needed: its tuner is replaced by a recorder)."""
    backend = object.__new__(CudaBackend)  # no kernels compiled
    calls = []
    backend.gemm = SimpleNamespace(cache_dir=None)
    backend.tune_linears = lambda groups, rows: calls.append((sorted(groups), rows))
    model = SimpleNamespace(linear_groups=lambda: {"qkv": [], "lm_head": []}, layers=[],
                            embed_tokens=torch.empty(0, dtype=torch.bfloat16))
    backend.prepare_model(model, "/cache", 8192)
    assert backend.gemm.cache_dir == "/cache"
    assert calls == [(["lm_head", "qkv"], list(BATCH_SIZES)), (["qkv"], [2048, 4096, 8192])]


def test_cuda_warm_up_runs_a_prefill_and_a_decode_and_leaves_the_runner_empty(monkeypatch):
    """CudaBackend.warm_up's plans, run here by a CPU worker's runner (only the final device
    sync is CUDA's)."""
    worker = Worker(ExecutorConfig(model="preset:tiny", num_gpu_blocks=8, swap_space_gib=0.001))
    steps = []
    launch = worker.runner.launch
    monkeypatch.setattr(worker.runner, "launch", lambda plan: steps.append(plan) or launch(plan))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    CudaBackend.warm_up(SimpleNamespace(device=None), worker.runner)
    assert [len(p.new_seqs) for p in steps] == [2, 0]
    assert list(steps[1].cached_seqs.seq_ids) == [0, 1]
    assert not len(worker.runner.input_batch)
