"""kernels.small_gemm on the GPU (sm_90): small_linear against a float64 reference within twice
F.linear's own error, for every token tile, split counts from 1 to many (the fixed-order sum of
fp32 partials), rows not a whole tile, strided x; the same bits on every launch and from a
CUDA-graph replay (the per-tile counters reset themselves); untouched output rows past M."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu import gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]

SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (256, 128), (1280, 640)]


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    return x, w


def _check(out, x, w, what):
    exact = F.linear(x.double(), w.double())
    bound = 2 * float((F.linear(x, w).double() - exact).abs().max()) + 1e-3
    err = float((out.double() - exact).abs().max())
    assert err <= bound, f"{what}: max error {err:.3e} over the bound {bound:.3e}"


@pytest.fixture(scope="module")
def sg():
    if not _hopper():
        pytest.skip("small_gemm runs on sm_90 only")
    from kernels import _compile, small_gemm

    _compile.warmup()
    return small_gemm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 50, 64, 100, 128])
def test_small_linear_computes_f_linears_product(sg, dtype, n, k, m):
    x, w = _inputs(m, n, k, dtype, m * 7 + n + k)
    ws = sg.SmallGemmWorkspace(x.device, n // sg.TILE_ROWS, 8)
    chunks = k // sg.CHUNK
    for splits in sorted({1, 2, 3, min(8, chunks), sg.default_splits(n, k, 132)}):
        if splits > chunks:
            continue
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        sg.small_linear(x, w, out, splits=splits, workspace=ws)
        _check(out, x, w, f"m={m} n={n} k={k} splits={splits}")
        assert not ws.counters.any(), "a launch left a tile counter set"


def test_same_bits_every_launch_and_from_a_graph(sg):
    """Splits finishing in any order give the same bits; a captured launch replays them."""
    m, n, k = 77, 4096, 14336
    x, w = _inputs(m, n, k, torch.bfloat16, 3)
    ws = sg.SmallGemmWorkspace(x.device, n // sg.TILE_ROWS, 16)
    first = sg.small_linear(x, w, splits=16, workspace=ws)
    for _ in range(20):
        assert torch.equal(sg.small_linear(x, w, splits=16, workspace=ws), first)
    out = torch.empty_like(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sg.small_linear(x, w, out, splits=16, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sg.small_linear(x, w, out, splits=16, workspace=ws)
    for _ in range(3):
        out.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    x2 = torch.randn_like(x)
    x.copy_(x2)  # new inputs in place: the replay computes them
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x2, w, "replay on new inputs")


def test_strided_rows_and_no_writes_past_m(sg):
    m, n, k = 40, 1024, 2048
    big = torch.randn(m, k + 64, device="cuda").to(torch.bfloat16)
    x = big[:, 32:32 + k]  # rows 16-byte aligned, row stride k + 64
    w = _inputs(1, n, k, torch.bfloat16, 5)[1]
    full = torch.full((64, n), 7.0, dtype=torch.bfloat16, device="cuda")
    ws = sg.SmallGemmWorkspace(x.device, n // sg.TILE_ROWS, 4)
    sg.small_linear(x, w, full[:m], splits=4, workspace=ws)
    _check(full[:m], x, w, "strided x")
    assert bool((full[m:] == 7.0).all()), "wrote rows past M"
    with pytest.raises(ValueError, match="SmallGemmWorkspace"):
        sg.small_linear(x, w, splits=4)
    with pytest.raises(ValueError, match="cannot run"):
        sg.small_linear(torch.randn(129, k, device="cuda").to(torch.bfloat16), w)
