"""pagedserve_kernels.fp8 on the GPU: cuBLASLt's scaled product computes the reference twin's FP8
W8A8 product (the same e4m3 activations and scales, summed in float32) within the output dtype's
rounding, at every row count a step has, for dynamic per-token, dynamic per-tensor and static
activation scales, with and without a bias; and it replays from a CUDA graph as it runs eagerly.
The kernels that quantize a product's rows per token (the norm's, SiLU-and-mul's and
ops.quantize_fp8) give the twin's quantize_fp8 bytes and scales bit for bit, in graphs too."""
from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import reference
from tests.gpu import gpu_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")]

ROWS = (1, 7, 64, 256, 4096)
SHAPES = ((6144, 4096), (4096, 14336), (48, 32))
FLOOR = torch.tensor(reference.FP8_MIN_SCALE).item()  # the scale floor as float32 scales hold it
MODES = {"dynamic per-token": (None, True), "dynamic per-tensor": (None, False),
         "static": (0.02, False)}


def _weight(n, k, seed, per_channel):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") * k**-0.5
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(n)
    scale = (amax / 448.0).float()
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_the_scaled_product_is_the_twins(rows, n, k, mode, dtype):
    from pagedserve_kernels import fp8

    static, per_token = MODES[mode]
    w, w_scale = _weight(n, k, rows + n + k, per_channel=mode != "static")
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype) if rows % 2 else None
    input_scale = None if static is None else torch.tensor(static, device="cuda")
    ours = fp8.fp8_linear(x, w, w_scale, input_scale, per_token, bias)
    # the twin's float32 sum before its rounding to the dtype: what an epilogue may round
    xq, x_scale = reference.quantize_fp8(x, input_scale, per_token)
    exact = (xq.double() @ w.double().t()) * x_scale.double() * w_scale.double().view(1, -1)
    if bias is not None:
        exact = exact + bias.double()
    assert ours.dtype == dtype and ours.shape == (rows, n)
    # bf16's rounding (the scaled product writes bf16), twice, relative to the output's scale
    bound = 2 * 2.0**-8 * float(exact.abs().max()) + 1e-3
    assert float((ours.double() - exact).abs().max()) <= bound


def test_the_scaled_product_replays_from_a_graph_as_eagerly():
    from pagedserve_kernels import fp8

    w, w_scale = _weight(4096, 4096, 1, per_channel=True)
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    eager = fp8.fp8_linear(x, w, w_scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8.fp8_linear(x, w, w_scale)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8.fp8_linear(x, w, w_scale)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8.fp8_linear(x, w, w_scale)) and not torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 576, 100])  # vectors; 72 vectors; the scalar path
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add-norm"])
def test_the_norm_quantizes_its_rows_as_quantize_fp8_does(dtype, hidden, add):
    """ops.rms_norm_fp8 against ops' own norm (rms_norm, or fused_add_rms_norm on copies)
    followed by the twin's quantize_fp8: e4m3 bytes and per-token scales bit for bit, the
    residual as fused_add_rms_norm leaves it, x untouched; a zero row takes the floor scale, a
    row with an outlier quantizes it to 448."""
    from pagedserve_kernels import ops

    g = torch.Generator(device="cuda").manual_seed(hidden * 2 + add)
    x = (torch.randn(37, hidden, generator=g, device="cuda") * 3).to(dtype)
    residual = torch.randn(37, hidden, generator=g, device="cuda").to(dtype)
    weight = (torch.rand(hidden, generator=g, device="cuda") + 0.5).to(dtype)
    x[3] = 0
    residual[3] = 0
    x[5, 7] = 80
    x_in, residual_in = x.clone(), residual.clone()
    if add:
        normed, want_residual = ops.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        got, scales = ops.rms_norm_fp8(x, weight, 1e-5, residual)
        assert torch.equal(residual, want_residual) and torch.equal(x, x_in)
    else:
        normed = ops.rms_norm(x, weight, 1e-5)
        got, scales = ops.rms_norm_fp8(x, weight, 1e-5)
        assert torch.equal(x, x_in) and torch.equal(residual, residual_in)
    want, want_scales = reference.quantize_fp8(normed)
    torch.cuda.synchronize()
    assert got.dtype == torch.float8_e4m3fn and got.shape == (37, hidden)
    assert torch.equal(scales, want_scales) and scales.shape == (37, 1)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert scales[3].item() == FLOOR and not got[3].float().any()
    assert got[5].float().abs().max().item() == 448.0


def test_the_norm_quantizes_in_a_graph_as_eagerly():
    from pagedserve_kernels import ops

    x = torch.randn(16, 4096, device="cuda").bfloat16()
    residual = torch.randn_like(x)
    weight = torch.rand(4096, device="cuda").bfloat16() + 0.5
    ops.rms_norm_fp8(x, weight, 1e-5, residual.clone())  # loads the kernel outside the capture
    torch.cuda.synchronize()
    start = residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, scales = ops.rms_norm_fp8(x, weight, 1e-5, residual)
    residual.copy_(start)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want, want_scales = ops.rms_norm_fp8(x, weight, 1e-5, start.clone())
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scales, want_scales)


WIDTHS = (4096, 14336, 576, 100)  # vectors; Llama-3-8B's intermediate; 72 vectors; scalar path


def _rows(num_rows, width, dtype, seed):
    """Random rows; with two or more, row 1 all zeros (the floor scale) and an outlier in row 0."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(num_rows, width, generator=g, device="cuda") * 3).to(dtype)
    if num_rows > 1:
        x[1] = 0
        x[0, width // 3] = 80
    return x


def _assert_quantized_as_the_twin(got, scales, rows):
    """(got, scales) are reference.quantize_fp8(rows) bit for bit; with two or more rows, row 1
    (all zeros) takes the floor scale and zeros and row 0's largest magnitude lands on 448."""
    want, want_scales = reference.quantize_fp8(rows)
    torch.cuda.synchronize()
    assert got.dtype == torch.float8_e4m3fn and got.shape == rows.shape and got.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (rows.shape[0], 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if rows.shape[0] > 1:
        assert scales[1].item() == FLOOR and not got[1].float().any()
        assert got[0].float().abs().max().item() == 448.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_quantize_fp8_is_the_twins_bit_for_bit(rows, width, dtype):
    from pagedserve_kernels import ops

    x = _rows(rows, width, dtype, rows * 31 + width)
    x_in = x.clone()
    got, scales = ops.quantize_fp8(x)
    _assert_quantized_as_the_twin(got, scales, x)
    assert torch.equal(x, x_in)


def _gate_up(rows, d, dtype, seed):
    """gate | up rows of _rows's kind: row 1 all zeros, and in row 0 a product near 1,000."""
    x = _rows(rows, 2 * d, dtype, seed)
    if rows > 1:
        x[0, d // 2], x[0, d + d // 2] = 20, 50
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_fp8_quantizes_ops_silu_and_mul_as_the_twin_does(rows, d, dtype):
    """ops.silu_and_mul_fp8 against ops' own silu_and_mul (its rounding to the dtype) followed
    by the twin's quantize_fp8, bit for bit; gate | up left as they are."""
    from pagedserve_kernels import ops

    gate_up = _gate_up(rows, d, dtype, rows * 17 + d)
    gate_up_in = gate_up.clone()
    got, scales = ops.silu_and_mul_fp8(gate_up)
    _assert_quantized_as_the_twin(got, scales, ops.silu_and_mul(gate_up))
    assert torch.equal(gate_up, gate_up_in)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [4096, 100])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "2-bytes-in"])
def test_both_read_strided_rows_of_a_wider_tensor(offset, width, dtype):
    """Inputs that are views of a wider tensor (rows 72 elements apart beyond their width,
    16-byte aligned, or each starting 2 bytes in: the scalar path) quantize as the twin does
    from the same view."""
    from pagedserve_kernels import ops

    wide = _rows(64, 2 * width + 72, dtype, width + offset)
    x = wide[:, offset:offset + width]
    got, scales = ops.quantize_fp8(x)
    _assert_quantized_as_the_twin(got, scales, x)
    gate_up = wide[:, offset:offset + 2 * width]
    got, scales = ops.silu_and_mul_fp8(gate_up)
    want = ops.silu_and_mul(gate_up)
    _assert_quantized_as_the_twin(got, scales, want)


def test_quantize_fp8_and_silu_and_mul_fp8_replay_from_a_graph_as_eagerly():
    from pagedserve_kernels import ops

    x = torch.randn(16, 4096, device="cuda").bfloat16()
    gate_up = torch.randn(16, 2 * 14336, device="cuda").bfloat16()
    ops.quantize_fp8(x)  # loads the kernels outside the capture
    ops.silu_and_mul_fp8(gate_up)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_x, x_scales = ops.quantize_fp8(x)
        got_act, act_scales = ops.silu_and_mul_fp8(gate_up)
    x.copy_(torch.randn_like(x) * 5)
    gate_up.copy_(torch.randn_like(gate_up) * 2)
    graph.replay()
    want_x, want_x_scales = ops.quantize_fp8(x)
    want_act, want_act_scales = ops.silu_and_mul_fp8(gate_up)
    torch.cuda.synchronize()
    assert torch.equal(got_x.view(torch.uint8), want_x.view(torch.uint8))
    assert torch.equal(x_scales, want_x_scales)
    assert torch.equal(got_act.view(torch.uint8), want_act.view(torch.uint8))
    assert torch.equal(act_scales, want_act_scales)
