"""benchmarks/trace_quant.py: the trace build's module lists production's wide and mma.sync
tiles, and the summary reads a trace as quant.cu's PS_QUANT_TRACE writes it (per CTA and run:
the SM, stages and how the output left, clock64 at the start, at the MMAs' retiring and at the
output, globaltimer at the start and at the output, and the mma.sync tiles' cycles at their
stage barriers); tiles are named as quant's."""
from __future__ import annotations

import re

import numpy as np
import pytest

from pagedserve_kernels import _compile

import trace_quant  # benchmarks/ is on the path (conftest)


def test_the_trace_module_builds_production_kernels_with_its_macro():
    source, macro, kernels = _compile.ON_DEMAND[trace_quant.TRACE_MODULE]
    assert (source, macro) == ("quant.cu", "PS_QUANT_TRACE")
    text = _compile.load_source("quant.cu")
    # wgt and wgs, bf16 and fp16, 64 / 128 / 256 rows; mma.sync, bf16 and fp16, 16 to 128 rows
    assert len(kernels) == 12 + 8
    for kernel in kernels:  # each instantiated by the source, traced or not
        assert re.search(rf"^PS_QUANT_PRODUCT(_WG[TS])?\({kernel},", text, re.MULTILINE), kernel
    assert text.count("#ifdef PS_QUANT_TRACE") >= 2  # the recorder, and the run counter
    assert "TRACE_RUNS = 8, TRACE_FIELDS = 7" in text  # the layout trace_quant reads
    assert (trace_quant.TRACE_RUNS, trace_quant.TRACE_FIELDS) == (8, 7)


def test_tiles_are_named_as_quant_names_them():
    assert trace_quant.tile_of("wgt128") == (128, "wgt")
    assert trace_quant.tile_of("wgs64") == (64, "wgs")
    assert trace_quant.tile_of("m16") == (16, "")


def _record(raw, cta, run, sm, stages, how, start, mma, end, start_ns, end_ns, waited=0):
    slot = raw.reshape(4096, trace_quant.TRACE_RUNS, trace_quant.TRACE_FIELDS)[cta, run]
    slot[:] = [sm | stages << 16 | how << 48, start, mma, end, start_ns, end_ns, waited]


def test_summary_of_two_ctas_at_two_ghz():
    raw = np.zeros(4096 * trace_quant.TRACE_RUNS * trace_quant.TRACE_FIELDS, dtype=np.uint64)
    # CTA 0: a whole tile of 64 stages, 1 µs each, stored in 2 µs; then 10 stages of a shared
    # tile, 1.5 µs each, its part written in 3 µs, 1 µs after the first run's end
    _record(raw, 0, 0, 5, 64, 1, 1000, 1000 + 128000, 1000 + 132000, 0, 66000)
    _record(raw, 0, 1, 5, 10, 2, 134000, 134000 + 30000, 134000 + 36000, 67000, 85000)
    # CTA 1 starts 0.5 µs later: 54 stages at 1.5 µs, then sums as the head in 4 µs
    _record(raw, 1, 0, 9, 54, 3, 500, 500 + 162000, 500 + 170000, 500, 85500)
    s = trace_quant.summary(trace_quant.runs_of(raw))
    assert s["ctas"] == 2 and s["runs"] == 3 and s["ghz"] == pytest.approx(2.0)
    assert s["span_us"] == pytest.approx(85.5)
    assert s["loop_us_per_stage"]["whole"]["median"] == pytest.approx(1.0)
    assert s["loop_us_per_stage"]["shared"]["median"] == pytest.approx(1.5)
    assert s["loop_us_per_stage"]["shared"]["n"] == 2
    assert s["epilogue_us"]["stored"]["median"] == pytest.approx(2.0)
    assert s["epilogue_us"]["part written"]["median"] == pytest.approx(3.0)
    assert s["epilogue_us"]["head summed"]["median"] == pytest.approx(4.0)
    assert s["epilogue_us"]["last summed"] == {}
    assert s["gaps_us"]["median"] == pytest.approx(1.0) and s["gaps_us"]["n"] == 1
    assert s["starts_us"]["max"] == pytest.approx(0.5)
    assert s["barrier_share_of_loop"] == {}  # the wide tiles record no barrier cycles


def test_the_barriers_share_of_an_mma_sync_tiles_loop():
    raw = np.zeros(4096 * trace_quant.TRACE_RUNS * trace_quant.TRACE_FIELDS, dtype=np.uint64)
    # two CTAs of 16 stages, 0.5 µs each at 2 GHz: a quarter and half of it at the barriers
    _record(raw, 0, 0, 1, 16, 2, 0, 16000, 20000, 0, 10000, waited=4000)
    _record(raw, 1, 0, 2, 16, 4, 0, 16000, 22000, 0, 11000, waited=8000)
    s = trace_quant.summary(trace_quant.runs_of(raw))
    assert s["loop_us_per_stage"]["shared"]["median"] == pytest.approx(0.5)
    assert s["barrier_share_of_loop"]["p10"] >= 0.25 and s["barrier_share_of_loop"]["max"] == 0.5
    assert s["epilogue_us"]["last summed"]["median"] == pytest.approx(3.0)


def test_a_split_product_is_traced_as_its_two_launches(monkeypatch):
    """--last-wave: a wgt tile the launcher splits is traced as its whole waves' launch, then the
    rest's in the form asked (each on its own), the same kernels, grids and first columns the
    launcher's split product launches; a tile without a wave to split, as one launch."""
    import torch

    from pagedserve_kernels import quant
    from tests.kernels.test_launchers import _wave_split_launches

    launched = _wave_split_launches(monkeypatch)[0]
    n, k, m = 28600, 512, 512  # 224 column blocks x 2 row tiles of 256 on 132 SMs
    weight = quant.repack(torch.zeros(k // 8, n, dtype=torch.int32),
                          torch.ones(k // 128, n, dtype=torch.bfloat16), None, 128, None)
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    for form, rest in (("parts", "w4a16_wgt_bf16_m256"), ("stream", "w4a16_wgs_bf16_m256")):
        parts = trace_quant.launches(quant, x, weight, out, (256, "wgt"), None, form)
        assert [p[0] for p in parts] == [" head", f" +{form}"]
        launched.clear()
        quant._kernel_product(x, weight, None, out, (256, "wgt"), None, form)
        split = [entry[:2] + (entry[3][0],) for entry in launched]
        launched.clear()
        for _, _, launch in parts:
            launch()
        assert [entry[:2] + (entry[3][0],) for entry in launched] == split
        assert [entry[0] for entry in launched] == ["w4a16_wgt_bf16_m256", rest]
    # whole waves (264 blocks of one row tile): one launch, the product's
    x = x[:256]
    whole = quant.repack(torch.zeros(k // 8, 264 * 128, dtype=torch.int32),
                         torch.ones(k // 128, 264 * 128, dtype=torch.bfloat16), None, 128, None)
    parts = trace_quant.launches(quant, x, whole, torch.empty(256, 264 * 128), (256, "wgt"),
                                 None, "stream")
    assert [p[0] for p in parts] == [""]

