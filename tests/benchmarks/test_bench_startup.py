"""bench_startup end to end on this tree: a first start on an empty cache folder (the preset
drawn and kept there) and a later one, each timed to the executor's ready line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.conftest import BENCHMARKS


@pytest.mark.slow
def test_a_first_and_a_later_start_are_timed(tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_startup", "--models",
                           "preset:tiny", "--runs", "1", "--json", str(out)],
                          cwd=BENCHMARKS.parent, check=True, timeout=300, capture_output=True,
                          text=True)
    [(tree, models)] = json.loads(out.read_text()).items()
    entry = models["preset:tiny"]
    assert len(entry["later"]) == 1 and entry["first"] > 0 and entry["median"] > 0
    assert f"{tree} preset:tiny: first {entry['first']:.2f} s" in done.stdout
