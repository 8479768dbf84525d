"""Both services as real processes with the executor on the GPU (cuda backend, CuPy kernels, CUDA
graphs): swap and recompute preemption still give greedy output identical to transformers."""
from __future__ import annotations

import pytest

from tests.gpu import gpu_ready
from tests.integration.test_end_to_end import check_preemption


pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_gpu_keeps_outputs_identical(tmp_path, mode):
    # Random preset weights are drawn on the executor's device: the reference draws on cuda too.
    executor_log = check_preemption(tmp_path, mode, ["--backend", "cuda", "--dtype", "float32"],
                                    device="cuda")
    assert "decode graphs (1, 2, 4" in executor_log
