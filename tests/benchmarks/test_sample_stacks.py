"""sample_stacks: what the sampler charges (a real thread inside and one outside the function),
and a real run of bench_serving whose executor reports where ModelRunner.launch spent its time."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from benchmarks.sample_stacks import GAP_S, Sampler, parse_target
from tests.benchmarks.conftest import BENCHMARKS


def launch(started: threading.Event, release: threading.Event) -> None:
    _inner(started, release)


def _inner(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(30)


def test_only_threads_inside_the_function_are_charged_to_their_innermost_frames():
    started, release, outside = threading.Event(), threading.Event(), threading.Event()
    inside = threading.Thread(target=launch, args=(started, release))
    other = threading.Thread(target=lambda: outside.wait(30))  # not inside `launch`
    for thread in (inside, other):
        thread.start()
    started.wait(30)
    try:
        sampler = Sampler(("test_sample_stacks.py", "launch"), depth=6)
        frames = sys._current_frames()
        sampler.sample(frames, 0.001, skip=threading.get_ident())
        sampler.sample(frames, 2 * GAP_S)
    finally:
        release.set()
        outside.set()
        for thread in (inside, other):
            thread.join()
    [(key, seconds)] = sampler.times.items()
    names = [frame.rsplit(":", 1)[1] for frame in key.split(" < ")]  # innermost first
    assert len(names) == 6 and names[0] == "wait" and names.index("_inner") + 1 == \
        names.index("launch")
    assert seconds == pytest.approx(0.001 + 2 * GAP_S)
    assert sampler.gaps[key] == pytest.approx(2 * GAP_S)
    assert sampler.total == pytest.approx(seconds)
    assert "total inside test_sample_stacks.py:launch" in sampler.report()


@pytest.mark.parametrize("text", ["launch", ":launch", "model_runner.py:", ""])
def test_a_target_names_a_file_and_a_function(text):
    with pytest.raises(ValueError, match="FILE:FUNCTION"):
        parse_target(text)
    assert parse_target("a/b.py:run") == ("a/b.py", "run")


@pytest.mark.parametrize("flags, message", [(["--depth", "0"], "--depth must be at least 1"),
                                            (["--function", "launch"], "FILE:FUNCTION")])
def test_bad_flags_stop_before_any_service_starts(flags, message):
    done = subprocess.run([sys.executable, "benchmarks/sample_stacks.py", *flags, "--",
                           "--workload", "W1"], timeout=60, cwd=BENCHMARKS.parent,
                          capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr and "services ready" not in done.stdout


@pytest.mark.slow
def test_a_run_reports_where_the_executors_launch_went():
    # Deep enough that a stack reaches launch itself: at the default five frames only the
    # samples that land in launch's own shallow bookkeeping name it, which a busy machine's
    # sampler may miss.
    done = subprocess.run(
        [sys.executable, "benchmarks/sample_stacks.py", "--depth", "16", "--", "--workload",
         "W1", "--model", "preset:tiny", "--backend", "cpu", "--num-requests", "4",
         "--skip-hf", "--time-limit", "60"],
        check=True, timeout=240, cwd=BENCHMARKS.parent, capture_output=True, text=True)
    report = done.stdout.split("== executor (pid ")[1]
    total = float(report.split("total inside model_runner.py:launch: ")[1].split()[0])
    assert total > 0 and ":launch < " in report and "model_runner.py" in report
