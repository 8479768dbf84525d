"""Worker from an ExecutorConfig: its info and a step round trip through its runner, on a preset."""
import pytest
import torch

from executor_svc.backends import get_backend
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
