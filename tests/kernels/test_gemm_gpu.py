"""pagedserve_kernels.gemm on the GPU: every cuBLASLt algorithm the heuristic offers computes
F.linear's product (within bf16/fp16 rounding of a float64 reference), a tuned product replays from
a CUDA graph as it runs eagerly, and a tuner reading the choices file runs the same algorithm, bit
for bit, as the one that wrote it (a restarted executor)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu import OUTER_VECTOR_CUBLASLT, gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]

SHAPES = [(1, 6144, 4096), (7, 576, 576), (64, 4096, 14336), (200, 28672, 4096), (8192, 4096, 4096)]


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    return x, w


def _spread(t, seed):
    """t with its rows' magnitudes spread over 2^-6..2^6, so that a scale per row (token or
    channel) applied to the wrong row or axis shows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    factors = torch.exp2(torch.rand(t.shape[0], generator=g, device="cuda") * 12 - 6)
    return (t.float() * factors[:, None]).to(t.dtype)


def _bound(x, w):
    """F.linear's own distance from float64, doubled, plus a little: what an algorithm may show."""
    exact = F.linear(x.double(), w.double())
    return exact, 2 * float((F.linear(x, w).double() - exact).abs().max()) + 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_heuristic_algorithm_computes_f_linears_product(dtype, m, n, k):
    from pagedserve_kernels.gemm import CublasLt

    lt = CublasLt(torch.device("cuda"))
    x, w = _inputs(m, n, k, dtype, m + n + k)
    exact, bound = _bound(x, w)
    algos = lt.algos(m, n, k, dtype)
    assert algos, "the heuristic offered nothing"
    for algo in algos:
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        lt.matmul(algo, x, w, out)
        err = float((out.double() - exact).abs().max())
        assert err <= bound, (lt.config(algo), err, bound)


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 4096), (200, 28672, 4096),
                                   (2048, 4096, 14336)])
def test_every_fp8_row_wise_algorithm_computes_the_scaled_product(m, n, k):
    """CublasLt.fp8_matmul (e4m3 operands, a scale per token and per channel as cuBLASLt's outer
    vectors): every algorithm its heuristic offers is reference.fp8_scaled_linear's product
    within bf16 rounding of its float64 value, eagerly and replayed from a CUDA graph with the
    scales then in place; skipped where this cuBLASLt has no outer-vector FP8 product."""
    from pagedserve_kernels import reference
    from pagedserve_kernels.gemm import CublasLt

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 products need Hopper")
    lt = CublasLt(torch.device("cuda"))
    x, w = _inputs(m, n, k, torch.bfloat16, m + n + k)
    x, w = _spread(x, m), _spread(w, n)
    xq, x_scale = reference.quantize_fp8(x)
    w_scale = w.float().abs().amax(dim=1) / 448.0
    wq = (w.float() / w_scale[:, None]).to(torch.float8_e4m3fn)
    exact = (xq.double() @ wq.double().t()) * x_scale.double() * w_scale.double()[None, :]
    bound = 2.0 ** -7 * float(exact.abs().max())  # one bf16 rounding of the largest value
    if lt.version < OUTER_VECTOR_CUBLASLT:
        pytest.skip(f"cuBLASLt {lt.version} has no outer-vector FP8 product")
    algos = lt.algos(m, n, k, torch.bfloat16, fp8=True)
    assert algos, "the heuristic offered nothing"
    ref = reference.fp8_scaled_linear(xq, x_scale, wq, w_scale, None, torch.bfloat16)
    assert float((ref.double() - exact).abs().max()) <= bound
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    for algo in algos:
        out.fill_(float("nan"))
        lt.fp8_matmul(algo, xq, x_scale, wq, w_scale, out)
        err = float((out.double() - exact).abs().max())
        assert err <= bound, (lt.config(algo), err, bound)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lt.fp8_matmul(algos[-1], xq, x_scale, wq, w_scale, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_tuned_products_replay_from_graphs_and_survive_a_restart(tmp_path):
    from pagedserve_kernels.gemm import LinearTuner

    device = torch.device("cuda")
    weights = {"o": [_inputs(1, 4096, 4096, torch.bfloat16, s)[1] for s in range(3)],
               "down": [_inputs(1, 4096, 14336, torch.bfloat16, 10 + s)[1] for s in range(2)]}
    rows = [16, 96]
    first = LinearTuner(device, cache_dir=str(tmp_path))
    report = first.tune(rows, weights, force_lt=True)  # cuBLASLt for every shape, timed
    assert len(report) == 4 and len(first.algos) == 4
    assert all(r["best"] is not None and r["algos"] >= 1 for r in report)
    second = LinearTuner(device, cache_dir=str(tmp_path))  # a restart: reads the file
    assert second.tune(rows, weights) == [] and second.algos.keys() == first.algos.keys()
    for (m, n, k, _), algo in first.algos.items():
        assert list(second.algos[(m, n, k, torch.bfloat16)].data) == list(algo.data)
        w = next(ws[0] for ws in weights.values() if ws[0].shape == (n, k))
        x = _inputs(m, 1, k, torch.bfloat16, m)[0]
        exact, bound = _bound(x, w)
        eager = first.linear(x, w)
        assert float((eager.double() - exact).abs().max()) <= bound
        assert torch.equal(second.linear(x, w), eager)  # the same kernel, bit for bit
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = first.linear(static_x, w)
        static_x.copy_(x.flip(0))  # new inputs, replayed
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, first.linear(x.flip(0), w))


def test_tuned_fp8_products_replay_from_graphs_and_survive_a_restart(tmp_path):
    """FP8 W8A8 groups tuned with cuBLASLt forced: each tuned product is the scaled product
    within one bf16 rounding of its float64 value, a restarted tuner reading the file runs the
    same bits, and a captured product replays new rows as it runs them eagerly."""
    from pagedserve_kernels import reference
    from pagedserve_kernels.gemm import FP8, LinearTuner

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 products need Hopper")
    device = torch.device("cuda")

    def pair(n, k, seed):
        w = _spread(_inputs(1, n, k, torch.bfloat16, seed)[1], seed)
        scale = w.float().abs().amax(dim=1) / 448.0
        return (w.float() / scale[:, None]).to(FP8), scale

    groups = {"o": [pair(4096, 4096, s) for s in range(3)],
              "down": [pair(4096, 14336, 10 + s) for s in range(2)]}
    rows = [16, 96]
    first = LinearTuner(device, cache_dir=str(tmp_path))
    if first._cublaslt().version < OUTER_VECTOR_CUBLASLT:
        pytest.skip("no outer-vector FP8 product in this cuBLASLt")
    report = first.tune(rows, groups, force_lt=True)
    assert len(report) == 4 and len(first.algos) == 4
    assert all(key[3] == FP8 for key in first.algos)
    second = LinearTuner(device, cache_dir=str(tmp_path))  # a restart: reads the file
    assert second.tune(rows, groups) == [] and second.algos.keys() == first.algos.keys()
    for (m, n, k, _), algo in first.algos.items():
        assert list(second.algos[(m, n, k, FP8)].data) == list(algo.data)
        w, scale = next(ps[0] for ps in groups.values() if ps[0][0].shape == (n, k))
        xq, x_scale = reference.quantize_fp8(_spread(_inputs(m, 1, k, torch.bfloat16, m)[0], m))
        exact = (xq.double() @ w.double().t()) * x_scale.double() * scale.double()[None, :]
        eager = first.fp8_linear(xq, x_scale, w, scale, None, torch.bfloat16)
        assert float((eager.double() - exact).abs().max()) <= 2.0 ** -7 * float(exact.abs().max())
        assert torch.equal(second.fp8_linear(xq, x_scale, w, scale, None, torch.bfloat16), eager)
        static_xq, static_scale = xq.clone(), x_scale.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = first.fp8_linear(static_xq, static_scale, w, scale, None,
                                          torch.bfloat16)
        static_xq.copy_(xq.flip(0))  # new rows, replayed
        static_scale.copy_(x_scale.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, first.fp8_linear(xq.flip(0), x_scale.flip(0), w, scale,
                                                        None, torch.bfloat16))


def test_untuned_row_counts_run_a_rung_without_waiting_for_the_gpu():
    """The first product of a cuBLAS kernel in a process waits for the GPU to go idle, and
    F.linear picks its kernel per row count; a row count the tuner never saw runs its rung's
    algorithm (one that ran while tuning): queued behind a second of GPU work, it returns
    before that work is done, and computes F.linear's product."""
    from pagedserve_kernels.gemm import LinearTuner

    tuner = LinearTuner(torch.device("cuda"))  # no cache folder: timed here
    w = _inputs(1, 4096, 4096, torch.bfloat16, 3)[1]
    lm_head = _inputs(1, 32000, 4096, torch.bfloat16, 4)[1]
    tuner.tune([8, 64, 512], {"o": [w], "lm_head": [lm_head]})
    assert [m for m, _ in tuner.rungs[(4096, 4096, torch.bfloat16)]] == [8, 64, 512]
    for m, weight in ((5, w), (300, w), (3001, w), (271, lm_head), (37, lm_head)):
        x = _inputs(m, 1, 4096, torch.bfloat16, m)[0]
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued first
        busy = torch.cuda.Event()
        busy.record()
        out = tuner.linear(x, weight)
        assert not busy.query(), f"{m} rows waited for the GPU"
        exact, bound = _bound(x, weight)
        assert float((out.double() - exact).abs().max()) <= bound
