"""Puts benchmarks/ on the path, as running its scripts does: side_by_side and vllm_w4 import
their neighbours (bench_serving, conversations) by their bare names."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
