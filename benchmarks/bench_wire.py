"""The step protocol's encodings on the host (issue 26): a StepResult of N sampled seqs encoded by
the executor (`wire.result_to_proto` + `SerializeToString`) and decoded by the scheduler
(`StepResult.FromString` + `wire.result_from_proto`), with and without logprobs, and a plan of N
decoding seqs encoded by the scheduler and decoded by the executor. Plain Python, no gRPC.

    python benchmarks/bench_wire.py --num-seqs 1 64 256 1024
    python benchmarks/bench_wire.py --against /tmp/old   # another tree, e.g. `git archive REV`

With --against, the same cases run on that tree's code in a child process, in rounds alternating
with this tree's, so that both see the same machine; each figure is the median over rounds of
each round's median. Times are the process's CPU time: on a shared machine, time spent waiting
for a core is not the encoding's.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LOGPROBS = 5  # each seq that asks for logprobs asks for this many top ones
VOCAB = 128256


def _result(num_seqs: int, logprobs: bool):
    """An executor StepResult of num_seqs sampled seqs (all asking for logprobs, or none)."""
    import numpy as np
    from executor_svc.step import SampledToken, StepResult

    rng = np.random.default_rng(num_seqs)
    seq_ids = rng.choice(2**40, num_seqs, replace=False).astype(np.uint64)  # [n]
    token_ids = rng.integers(0, VOCAB, num_seqs)  # [n] int64
    asked = tuple(
        SampledToken(int(s), int(t), float(-rng.random()),
                     tuple(rng.integers(0, VOCAB, TOP_LOGPROBS).tolist()),
                     tuple((-rng.random(TOP_LOGPROBS)).tolist()))
        for s, t in zip(seq_ids, token_ids)) if logprobs else ()
    return StepResult(3, seq_ids, token_ids, 9.5, 10.2, asked)


def _plan(num_seqs: int):
    """A scheduler StepPlan of num_seqs seqs decoding one token each; one in 16 takes a block."""
    from scheduler_svc.plan import StepPlan

    rng = random.Random(num_seqs)
    plan = StepPlan(3)
    for i in range(num_seqs):
        computed = rng.randrange(64, 2048)
        plan.cached_seqs.append(10_000 + i, 1, computed, [rng.randrange(54_000)] * (i % 16 == 0))
    return plan


def _cases(sizes: list[int]) -> dict[str, tuple]:
    """name -> (encode(), decode(bytes)) for each case."""
    from executor_svc import wire as executor_wire
    from protos import executor_pb2
    from scheduler_svc import wire as scheduler_wire

    cases = {}
    for n in sizes:
        for logprobs in (False, True):
            result = _result(n, logprobs)
            cases[f"result {n}{' +logprobs' if logprobs else ''}"] = (
                lambda r=result: executor_wire.result_to_proto(r).SerializeToString(),
                lambda data: scheduler_wire.result_from_proto(
                    executor_pb2.StepResult.FromString(data)))
        plan = _plan(n)
        cases[f"plan {n}"] = (
            lambda p=plan: scheduler_wire.plan_to_proto(p).SerializeToString(),
            lambda data: executor_wire.plan_from_proto(executor_pb2.StepPlan.FromString(data)))
    return cases


def _median_us(fn, arg, repeats: int, min_s: float = 0.005) -> float:
    """Median over `repeats` timings of one call, each timing a loop of at least min_s."""
    number = 1
    while True:
        start = time.process_time()
        for _ in range(number):
            fn(*arg)
        if time.process_time() - start >= min_s:
            break
        number *= 2
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(number):
            fn(*arg)
        times.append((time.process_time() - start) / number)
    return 1e6 * statistics.median(times)


def measure(sizes: list[int], repeats: int) -> dict[str, list[float]]:
    """name -> [encode us, decode us, bytes] on the code that `import` finds first."""
    out = {}
    for name, (encode, decode) in _cases(sizes).items():
        data = encode()
        decode(data)
        out[name] = [_median_us(encode, (), repeats), _median_us(decode, (data,), repeats),
                     len(data)]
    return out


def _child(root: Path, sizes: list[int], repeats: int) -> dict[str, list[float]]:
    done = subprocess.run([sys.executable, __file__, "--child", "--root", str(root),
                           "--repeats", str(repeats), "--num-seqs", *map(str, sizes)],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _median_of(rounds: list[dict], name: str, i: int) -> float:
    return statistics.median(r[name][i] for r in rounds)


def report(sizes: list[int], rounds: int, repeats: int, against: Path | None) -> None:
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(_child(ROOT, sizes, repeats))
        if against is not None:
            theirs.append(_child(against, sizes, repeats))
    header = "case                   encode us  decode us  total us   bytes"
    if against is not None:
        header += f"   | {against.name}: encode  decode   total   bytes"
    print(header)
    for name in ours[0]:
        enc, dec = _median_of(ours, name, 0), _median_of(ours, name, 1)
        line = f"{name:<20} {enc:>10.1f} {dec:>10.1f} {enc + dec:>9.1f} {ours[0][name][2]:>7}"
        if theirs:
            t_enc, t_dec = _median_of(theirs, name, 0), _median_of(theirs, name, 1)
            line += (f"   | {t_enc:>14.1f} {t_dec:>7.1f} {t_enc + t_dec:>7.1f} "
                     f"{theirs[0][name][2]:>7}")
        print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per tree")
    p.add_argument("--repeats", type=int, default=15, help="timings per case in a round")
    p.add_argument("--against", type=Path, help="another tree's root, measured alongside")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one round on the tree at --root: its modules first on the path
        sys.path.insert(0, str(args.root.resolve()))
        import executor_svc
        import scheduler_svc

        for package in (executor_svc, scheduler_svc):
            if not Path(package.__file__).resolve().is_relative_to(args.root.resolve()):
                raise SystemExit(f"{package.__name__} came from {package.__file__}, not "
                                 f"{args.root}")
        print(json.dumps(measure(args.num_seqs, args.repeats)))
        return
    report(args.num_seqs, args.rounds, args.repeats, args.against)


if __name__ == "__main__":
    main()
