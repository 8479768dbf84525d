"""pagedserve_kernels.gemm on the CPU: which products LinearTuner sends to cuBLASLt (a stand-in
records the calls), and the choices file (read, validated, rewritten whole). The GPU side (every
algorithm against F.linear, inside graphs, across a restart) is in test_gemm_gpu.py."""
from __future__ import annotations

import ctypes
import json

import torch
import torch.nn.functional as F

from pagedserve_kernels import fp8, gemm, reference


class FakeLt:
    """Records matmul calls and writes F.linear's product, as cuBLASLt would."""

    version = 1

    def __init__(self, refused=(), wrong=()) -> None:
        self.calls, self.refused, self.wrong = [], set(refused), set(wrong)

    def matmul(self, algo, x, w, out) -> None:
        data = tuple(algo.data)
        self.calls.append((data, tuple(x.shape), tuple(w.shape)))
        if data in self.refused:
            raise RuntimeError("cublasLtMatmul failed: cuBLAS status 7")
        out.copy_(F.linear(x, w) if data not in self.wrong else torch.zeros_like(out))

    def fp8_matmul(self, algo, xq, x_scale, w, w_scale, out) -> None:
        data = tuple(algo.data)
        self.calls.append((data, tuple(xq.shape), tuple(w.shape), tuple(x_scale.shape)))
        if data in self.refused:
            raise RuntimeError("cublasLtMatmul failed: cuBLAS status 7")
        product = fp8.fp8_scaled_linear(xq, x_scale, w, w_scale, None, torch.bfloat16)
        out.copy_(product if data not in self.wrong else torch.zeros_like(out))


def tuner_with(entries: dict) -> tuple[gemm.LinearTuner, FakeLt]:
    tuner = gemm.LinearTuner(torch.device("cpu"))
    tuner._lt = lt = FakeLt()
    tuner._store = gemm.GemmChoices(None)
    tuner._store.entries.update(entries)
    return tuner, lt


def test_tuned_shapes_go_to_cublaslt_and_everything_else_to_f_linear():
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    other = torch.randn(16, 32, dtype=torch.bfloat16)
    tuner, lt = tuner_with({"bfloat16 8 48 32": [7] * 8, "bfloat16 8 48 32 rung": [7] * 8,
                            "bfloat16 4 48 32": None, "bfloat16 4 48 32 rung": None})
    report = tuner.tune([8, 4], {"qkv": [w, w.clone()]})
    assert report == []  # both shapes came from the choices file: nothing timed
    assert list(tuner.algos) == [(8, 48, 32, torch.bfloat16)]
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    assert len(lt.calls) == 1  # the file's choice, run once against F.linear before its use
    assert torch.equal(tuner.linear(x, w), F.linear(x, w)) and len(lt.calls) == 2
    assert lt.calls[1] == ((7,) * 8, (8, 32), (48, 32))
    # F.linear: a chosen-F.linear shape, a bias, a strided input, another weight shape, another
    # dtype
    tuner.linear(torch.randn(4, 32, dtype=torch.bfloat16), w)
    tuner.linear(x, w, torch.zeros(48, dtype=torch.bfloat16))
    wide = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(tuner.linear(wide[:, ::2], w), F.linear(wide[:, ::2], w))
    tuner.linear(x, other)
    tuner.linear(x.float(), w.float())
    assert len(lt.calls) == 2


def aligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t at a 256-byte aligned address (what cuBLASLt's algorithm search assumes)."""
    size = t.numel() * t.element_size()
    flat = torch.empty(size + 256, dtype=torch.uint8)
    start = -flat.data_ptr() % 256
    return flat[start:start + size].view(t.dtype).view(t.shape).copy_(t)


def test_tuned_fp8_shapes_go_to_cublaslt_and_everything_else_to_the_scaled_product():
    """FP8 W8A8 groups are (e4m3 weight, scale a channel) pairs, tuned under their own keys: a
    tuned shape (and an untuned row count, by its rung) runs the algorithm with a scale a row
    (a per-tensor one spread over the rows); a bias, fp16 rows, a shape that chose the library,
    or a dense weight of the same shape take the library's products."""
    fp8_type = torch.float8_e4m3fn
    w = aligned((torch.randn(48, 32) * 0.2).to(fp8_type))
    scale = aligned(torch.rand(48) + 0.5)
    tuner, lt = tuner_with({"float8_e4m3fn 8 48 32": [7] * 8, "float8_e4m3fn 8 48 32 rung": [7] * 8,
                            "float8_e4m3fn 4 48 32": None, "float8_e4m3fn 4 48 32 rung": None})
    assert tuner.tune([8, 4], {"qkv": [(w, scale), (w.clone(), scale.clone())]}) == []
    assert list(tuner.algos) == [(8, 48, 32, fp8_type)] and len(lt.calls) == 1
    xq, x_scale = map(aligned, reference.quantize_fp8(torch.randn(20, 32, dtype=torch.bfloat16)))
    for m in (8, 3, 20):  # tuned; below and past the only rung
        out = tuner.fp8_linear(xq[:m], x_scale[:m], w, scale, None, torch.bfloat16)
        assert torch.equal(out, fp8.fp8_scaled_linear(xq[:m], x_scale[:m], w, scale, None,
                                                      torch.bfloat16))
        assert lt.calls[-1] == ((7,) * 8, (m, 32), (48, 32), (m, 1)), m
    one = aligned(torch.full((1, 1), 0.01))
    out = tuner.fp8_linear(xq[:8], one, w, scale, None, torch.bfloat16)
    assert lt.calls[-1][3] == (8, 1)
    assert torch.equal(out, fp8.fp8_scaled_linear(xq[:8], one, w, scale, None, torch.bfloat16))
    calls = len(lt.calls)
    tuner.fp8_linear(xq[:4], x_scale[:4], w, scale, None, torch.bfloat16)  # the library chosen
    tuner.fp8_linear(xq[:8], x_scale[:8], w, scale, torch.zeros(48, dtype=torch.bfloat16),
                     torch.bfloat16)
    tuner.fp8_linear(xq[:8], x_scale[:8], w, scale, None, torch.float16)
    tuner.fp8_linear(xq[:8], x_scale[:8], w, scale.double(), None, torch.bfloat16)
    tuner.fp8_linear(xq[1:9], x_scale[1:9], w, scale, None, torch.bfloat16)  # 32 bytes in
    tuner.fp8_linear(xq[:8, :16], x_scale[:8], w[:, :16], scale, None, torch.bfloat16)
    tuner.linear(torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(48, 32,
                                                                      dtype=torch.bfloat16))
    assert len(lt.calls) == calls
    # pairs that cannot be tuned: a scale per tensor, a bf16 weight, mixed in a group
    assert tuner.tune([16], {"a": [(w, scale[:1])], "b": [(w.bfloat16(), scale)],
                             "c": [(w, scale), w.bfloat16()]}) == []


def test_an_fp8_group_is_timed_against_the_scaled_product():
    """Timing an FP8 shape runs the library's scaled product and each algorithm on rows
    quantized per token; an algorithm whose product differs is never chosen."""
    w = (torch.randn(48, 32) * 0.2).to(torch.float8_e4m3fn)
    scale = torch.rand(48) + 0.5
    tuner, lt = tuner_with({})
    lt.wrong = {(2,) * 8}
    product = gemm._Product(lt, 5, (w, scale), torch.device("cpu"))
    assert product.x.dtype == torch.float8_e4m3fn and product.x_scale.shape == (5, 1)
    ref = product.library((w, scale))
    assert torch.equal(ref, fp8.fp8_scaled_linear(product.x, product.x_scale, w, scale, None,
                                                  torch.bfloat16))
    assert tuner._computes_linear(gemm.Algo((ctypes.c_uint64 * 8)(*[1] * 8)), 5, (w, scale))
    assert not tuner._computes_linear(gemm.Algo((ctypes.c_uint64 * 8)(*[2] * 8)), 5, (w, scale))


def test_untuned_row_counts_run_the_next_tuned_counts_fastest_algorithm():
    """A row count nobody tuned takes the rung of the smallest tuned count above it (past the
    last, the last's), also where F.linear was chosen at that count: F.linear's kernel would
    depend on the row count, and a kernel's first run waits for the GPU."""
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    tuner, lt = tuner_with({
        "bfloat16 4 48 32": [1] * 8, "bfloat16 4 48 32 rung": [1] * 8,
        "bfloat16 16 48 32": None, "bfloat16 16 48 32 rung": [2] * 8,  # F.linear won at 16
        "bfloat16 64 48 32": None, "bfloat16 64 48 32 rung": None,  # no algorithm qualified
        "bfloat16 256 48 32": [3] * 8, "bfloat16 256 48 32 rung": [3] * 8})
    assert tuner.tune([256, 4, 64, 16], {"o": [w]}) == []
    assert [m for m, _ in tuner.rungs[(48, 32, torch.bfloat16)]] == [4, 16, 256]
    lt.calls.clear()
    for m, algo in ((1, 1), (3, 1), (5, 2), (15, 2), (17, 3), (100, 3), (300, 3), (9000, 3)):
        x = torch.randn(m, 32, dtype=torch.bfloat16)
        assert torch.equal(tuner.linear(x, w), F.linear(x, w))
        assert lt.calls[-1] == ((algo,) * 8, (m, 32), (48, 32)), m
    lt.calls.clear()
    tuner.linear(torch.randn(16, 32, dtype=torch.bfloat16), w)  # tuned: F.linear chosen
    tuner.linear(torch.randn(64, 32, dtype=torch.bfloat16), w)
    tuner.linear(torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(48, 16,
                                                                     dtype=torch.bfloat16))
    assert lt.calls == []  # (no rungs for a [48, 16] weight)
    # cuBLASLt refuses a rung at some row count (nothing ran): F.linear there, from then on
    lt.refused = {(3,) * 8}
    x = torch.randn(77, 32, dtype=torch.bfloat16)
    assert torch.equal(tuner.linear(x, w), F.linear(x, w)) and len(lt.calls) == 1
    assert torch.equal(tuner.linear(x, w), F.linear(x, w)) and len(lt.calls) == 1


def test_a_file_choice_that_fails_or_differs_is_timed_again():
    """A choices file is trusted no further than one run: an algorithm cuBLASLt refuses, or one
    whose product is not F.linear's (chosen or rung), is timed again (here: F.linear wins, no
    algorithm qualifies) and never used; so is a shape whose rung the file lacks (a file
    written before rungs)."""
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    tuner, lt = tuner_with({"bfloat16 8 48 32": [9] * 8, "bfloat16 8 48 32 rung": [9] * 8,
                            "bfloat16 4 48 32": None, "bfloat16 4 48 32 rung": [3] * 8,
                            "bfloat16 2 48 32": [5] * 8, "bfloat16 2 48 32 rung": [5] * 8,
                            "bfloat16 1 48 32": [5] * 8})
    lt.refused, lt.wrong = {(9,) * 8}, {(3,) * 8}
    timed = []

    def time_choices(name, m, weights):
        timed.append(m)
        return {"best": None, "linear_us": 1.0}

    tuner.time_choices = time_choices
    assert len(tuner.tune([8, 4, 2, 1], {"qkv": [w]})) == 3
    assert timed == [8, 4, 1] and list(tuner.algos) == [(2, 48, 32, torch.bfloat16)]
    for m in (8, 4, 1):
        assert tuner._store.entries[f"bfloat16 {m} 48 32"] is None  # F.linear from now on
        assert tuner._store.entries[f"bfloat16 {m} 48 32 rung"] is None
    assert [m for m, _ in tuner.rungs[(48, 32, torch.bfloat16)]] == [2]


def test_an_untuned_tuner_is_f_linear():
    tuner = gemm.LinearTuner(torch.device("cpu"))
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(tuner.linear(x, w, b), F.linear(x, w, b))
    assert tuner._lt is None  # no library loaded for that


def test_float32_weights_are_never_tuned():
    tuner, _ = tuner_with({})
    assert tuner.tune([8], {"o": [torch.randn(16, 16)]}) == [] and not tuner.algos


def test_choices_file_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "sub" / "gemm.json"
    store = gemm.GemmChoices(str(path))
    assert store.entries == {}
    store.entries = {"bfloat16 8 48 32": [2**64 - 1, 0, 1, 2, 3, 4, 5, 6], "bfloat16 4 48 32": None}
    store.save()
    assert gemm.GemmChoices(str(path)).entries == store.entries
    assert [p.name for p in path.parent.iterdir()] == ["gemm.json"]  # no temporary left
    for bad in ("{not json", json.dumps({"bfloat16 8 48 32": [1, 2]}),
                json.dumps({"k": [2**64] + [0] * 7}), json.dumps([1, 2]),
                json.dumps({"k": ["1"] * 8})):
        path.write_text(bad)
        assert gemm.GemmChoices(str(path)).entries == {}, bad


def test_an_algorithm_survives_the_file_bit_for_bit(tmp_path):
    data = [2**63 + 5, 1, 0, 2**40, 9, 8, 7, 6]
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"float16 16 32 64": data, "float16 16 32 64 rung": data}))
    tuner = gemm.LinearTuner(torch.device("cpu"))
    tuner._lt = FakeLt()
    tuner.choices_path = lambda: str(path)
    tuner.tune([16], {"down": [torch.zeros(32, 64, dtype=torch.float16)]})
    algo = tuner.algos[(16, 32, 64, torch.float16)]
    assert isinstance(algo, gemm.Algo) and list(algo.data) == data
    assert [(m, list(a.data)) for m, a in tuner.rungs[(32, 64, torch.float16)]] == [(16, data)]
    assert ctypes.sizeof(gemm.Algo) == 64 and ctypes.sizeof(gemm._HeuristicResult) == 96


def test_a_folder_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = gemm.GemmChoices(str(blocker / "sub" / "gemm.json"))  # its folder is a file
    store.entries = {"bfloat16 1 2 3": None}
    store.save()  # (root writes through permissions, so a file stands in the folder's way)
    assert "not saved" in caplog.text and [p.name for p in tmp_path.iterdir()] == ["file"]
