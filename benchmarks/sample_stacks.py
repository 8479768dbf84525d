"""Where one function's time goes in a running service, by sampling: a thread in the service
(started from a `sitecustomize` put on the services' PYTHONPATH for this run only) looks at every
other thread's stack every 0.5 ms and, while one is inside the function, charges the time since
its last look to that thread's innermost frames. Runs bench_serving (or with --runner online,
bench_online, whose --launch ours starts the services) with the arguments after `--`, then prints
the stacks that took the most time.

    python3 benchmarks/sample_stacks.py -- --workload W1 --skip-hf
    python3 benchmarks/sample_stacks.py --service scheduler --function scheduler.py:schedule \\
        -- --workload W2 --skip-hf
    python3 benchmarks/sample_stacks.py --runner online -- --launch ours --workload W1-json \\
        --tokenizer <tokenizer> --num-requests 256

A slice charged to a stack is wall time there: the thread ran, or waited in C with the GIL
released (a GPU wait, a lock), or waited for the GIL. A C call that holds the GIL holds the
sampler back too; its time lands on the stack seen after it, and slices over 3 ms are also
counted apart (`gaps`). Found with it (RESULTS.md, tenth session): W1's prompt steps spent 141 of
their 164 ms of launch in the lm_head's F.linear, waiting for a cuBLAS kernel's first run.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import importlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERIOD_S = 0.0005
GAP_S = 0.003  # a slice this long: the sampler was held back (GIL held in C, or descheduled)
DUMP_EVERY_S = 2.0

_SITECUSTOMIZE = '''
import os, sys
if os.environ.get("PAGEDSERVE_SAMPLE_SERVICE", "-") + "_svc.main" in " ".join(sys.orig_argv):
    sys.path.insert(0, %r)
    from benchmarks.sample_stacks import start
    start()
'''


def parse_target(text: str) -> tuple[str, str]:
    """'file.py:function' -> ('file.py', 'function')."""
    path, sep, name = text.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"expected FILE:FUNCTION (e.g. model_runner.py:launch), got {text!r}")
    return path, name


class Sampler:
    """Time per stack (its innermost `depth` frames) of the threads inside the target function."""

    def __init__(self, target: tuple[str, str], depth: int = 5) -> None:
        self.target, self.depth = target, depth
        self.times: collections.Counter = collections.Counter()  # stack -> seconds
        self.gaps: collections.Counter = collections.Counter()  # of it in slices over GAP_S
        self.total = 0.0  # seconds of threads inside the target

    def key(self, frame) -> str | None:
        """The innermost frames of a stack inside the target, outermost last; None outside."""
        names, inside = [], False
        while frame is not None:
            code = frame.f_code
            if len(names) < self.depth:
                names.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:"
                             f"{code.co_name}")
            if code.co_name == self.target[1] and code.co_filename.endswith(self.target[0]):
                inside = True
            frame = frame.f_back
        return " < ".join(names) if inside else None

    def sample(self, frames: dict, elapsed: float, skip: int | None = None) -> None:
        """Charges `elapsed` seconds to each thread in `frames` (thread id -> frame, as
        sys._current_frames()) that is inside the target; `skip`: the sampler's own thread."""
        for thread_id, frame in frames.items():
            if thread_id == skip or (key := self.key(frame)) is None:
                continue
            self.total += elapsed
            self.times[key] += elapsed
            if elapsed > GAP_S:
                self.gaps[key] += elapsed

    def report(self, top: int = 40) -> str:
        lines = [f"total inside {self.target[0]}:{self.target[1]}: {self.total * 1e3:.1f} ms"]
        for key, seconds in self.times.most_common(top):
            lines.append(f"{seconds * 1e3:10.1f} ms (gaps {self.gaps[key] * 1e3:8.1f})  {key}")
        return "\n".join(lines) + "\n"


def start() -> None:
    """In a service (from the sitecustomize): samples in a daemon thread, writing the report to
    $PAGEDSERVE_SAMPLE_OUT.<pid> every DUMP_EVERY_S and at exit."""
    sampler = Sampler(parse_target(os.environ["PAGEDSERVE_SAMPLE_FUNCTION"]),
                      int(os.environ.get("PAGEDSERVE_SAMPLE_DEPTH", "5")))
    path = f"{os.environ['PAGEDSERVE_SAMPLE_OUT']}.{os.getpid()}"
    lock = threading.Lock()

    def dump() -> None:
        with lock:
            text = sampler.report()
        Path(path).write_text(text)

    def run() -> None:
        me = threading.get_ident()
        last = last_dump = time.perf_counter()
        while True:
            time.sleep(PERIOD_S)
            now = time.perf_counter()
            with lock:
                sampler.sample(sys._current_frames(), now - last, skip=me)
            last = now
            if now - last_dump > DUMP_EVERY_S:
                dump()
                last_dump = now

    atexit.register(dump)
    threading.Thread(target=run, name="stack-sampler", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--service", choices=("executor", "scheduler"), default="executor")
    p.add_argument("--function", default="model_runner.py:launch",
                   help="FILE:FUNCTION whose time is sampled (a file name's ending)")
    p.add_argument("--depth", type=int, default=5, help="innermost frames that name a stack")
    p.add_argument("--runner", choices=("serving", "online"), default="serving",
                   help="the benchmark the arguments after -- go to: bench_serving (gRPC, "
                        "offline) or bench_online (HTTP, --launch ours; W1-json among its "
                        "workloads)")
    args = p.parse_args(ours)
    try:
        parse_target(args.function)  # fails here, not in the service
    except ValueError as err:
        p.error(str(err))
    if args.depth < 1:
        p.error(f"--depth must be at least 1, got {args.depth}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_" + args.runner)
    from trace_ttft import put_sitecustomize

    tmp = Path(tempfile.mkdtemp(prefix="sample_stacks_"))
    put_sitecustomize(tmp / "site", _SITECUSTOMIZE % str(ROOT), ROOT)
    os.environ.update(PAGEDSERVE_SAMPLE_SERVICE=args.service,
                      PAGEDSERVE_SAMPLE_FUNCTION=args.function,
                      PAGEDSERVE_SAMPLE_DEPTH=str(args.depth),
                      PAGEDSERVE_SAMPLE_OUT=str(tmp / "stacks"))

    bench.main(rest)
    reports = sorted(tmp.glob("stacks.*"))
    if not reports:
        raise SystemExit(f"no report from the {args.service}: the sampler did not start")
    for report in reports:
        print(f"== {args.service} (pid {report.suffix[1:]}) ==")
        print(report.read_text())


if __name__ == "__main__":
    main()
