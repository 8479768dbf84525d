"""benchmarks/bench_programmatic.py: --no-trigger compiles the early start out of every module but
the products' (whose kernels wait and start their dependents as a programmatic launch needs)."""
from __future__ import annotations

from pagedserve_kernels import _compile

import bench_programmatic  # benchmarks/ is on the path (conftest)


def test_no_trigger_removes_the_early_start_from_the_ops_and_attention_only(monkeypatch):
    monkeypatch.setattr(_compile, "load_source", _compile.load_source)  # restored afterwards
    before = {name: _compile.load_source(name) for name in ("ops.cu", "attention.cu", "quant.cu")}
    assert all("ps::launch_dependents();" in text for text in before.values())
    bench_programmatic.without_early_trigger()
    assert "ps::launch_dependents();" not in _compile.load_source("ops.cu")
    assert "ps::launch_dependents();" not in _compile.load_source("attention.cu")
    assert _compile.load_source("quant.cu") == before["quant.cu"]
    # the rest of the source is untouched: only the calls became empty statements
    after = _compile.load_source("ops.cu")
    assert after == before["ops.cu"].replace("ps::launch_dependents();", ";")
