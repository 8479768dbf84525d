"""Both services as real processes with the executor on the GPU (cuda backend, CuPy kernels, CUDA
graphs): swap and recompute preemption still give greedy output identical to transformers."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.harness import generate, start_services
from tests.integration.hf_reference import hf_greedy
from tests.integration.test_end_to_end import TINY, assert_pools_whole, random_prompts


def _gpu_ready() -> bool:
    try:
        import cupy
        import torch

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not _gpu_ready(), reason="needs CuPy and a GPU")]


@pytest.mark.parametrize("swap_space,mode", [("1", "swap"), ("0", "recompute")])
def test_preemption_on_gpu_keeps_outputs_identical(tmp_path, swap_space, mode):
    services = start_services(
        tmp_path, ["--model", TINY, "--backend", "cuda", "--dtype", "float32",
                   "--num-gpu-blocks", "24", "--swap-space", swap_space],
        ["--max-num-seqs", "16"])
    try:
        prompts = random_prompts(10, seed=4, low=30, high=50)
        with grpc.insecure_channel(services.scheduler_address) as ch, ThreadPoolExecutor(10) as pool:
            stub = services.stub(ch)
            results = list(pool.map(lambda p: generate(stub, p, max_tokens=40), prompts))
        for prompt, (ids, _, _) in zip(prompts, results):
            assert ids == hf_greedy(TINY, prompt, 40, device="cuda")  # weights drawn on cuda
        m = services.metrics()
        assert m[f'pagedserve_preemptions{{mode="{mode}"}}'] > 0, m
        if mode == "swap":
            assert m['pagedserve_blocks_swapped{direction="out"}'] > 0
            assert m['pagedserve_blocks_swapped{direction="in"}'] > 0
        assert_pools_whole(services)
        assert "decode graphs (1, 2, 4" in services.log_of("executor")
    finally:
        services.stop()
