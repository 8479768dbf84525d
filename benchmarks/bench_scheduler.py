"""The scheduler's host cost per step on the CPU (issue 10): `schedule()`, the plan's encoding
(`wire.plan_to_proto` + `SerializeToString`, what the client sends), the executor's reply parsed
(`StepResult.FromString` + `wire.result_from_proto`) and `update_from_output`, at N running
sequences. Plain Python: no GPU, no gRPC server, no network.

    python -m benchmarks.bench_scheduler --num-seqs 256 512 1024 --steps 200 --json out.json

The block manager is sized like the H200 8B case (block size 16, 54,000 GPU blocks, 2,048 CPU
blocks); the token budget is 8192 and max_num_seqs = N. Two steps are in flight, as in the engine:
step k's result is applied, then step k+2 is planned and encoded. Cases:
  decode  N sequences in steady decode (prompts 64-1024 tokens, long outputs).
  mixed   as decode, but 2 sequences finish (EOS) and 2 new ones are admitted each step, their
          whole prompts prefilled in that step (~1,100 prompt tokens per step, as in W2).
  churn   1 sequence finishes and 1 new one is admitted each step.
With 8192 tokens a step and N <= 1,024, an admitted prompt (<= 1,024 tokens) is prefilled in one
chunk. The pool holds ~250 measured steps at N = 1,024 before anything is preempted (the count is
printed). Prompts and tokens come from random.Random(seed); every run is the same.
Request arrivals (add_seq) and the fake executor are not timed.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protos import executor_pb2  # noqa: E402
from scheduler_svc import wire  # noqa: E402
from scheduler_svc.block_manager import BlockManager  # noqa: E402
from scheduler_svc.config import SchedulerConfig  # noqa: E402
from scheduler_svc.plan import StepPlan  # noqa: E402
from scheduler_svc.sampling_params import SamplingParams, StoppingParams  # noqa: E402
from scheduler_svc.scheduler import Scheduler  # noqa: E402
from scheduler_svc.sequence import Sequence  # noqa: E402

BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 16, 54_000, 2_048
MAX_NUM_BATCHED_TOKENS = 8192
MAX_MODEL_LEN = 8192
VOCAB, EOS = 128_000, 128_001  # Llama-3 sizes; the fake executor never samples EOS by chance
PROMPT_RANGE = (64, 1024)
CASES = {"decode": 0, "mixed": 2, "churn": 1}  # name: sequences finished and admitted per step
PHASES = ("schedule", "encode", "decode", "update")
STEPS_IN_FLIGHT = 2


class FakeExecutor:
    """Answers a plan with the StepResult bytes the real executor would send: one sampled token
    per sampling sequence; `finish` of them (not already doomed) get EOS."""

    def __init__(self, rng: random.Random, finish: int) -> None:
        self.rng = rng
        self.finish = finish
        self.doomed: set[int] = set()

    def result_for(self, plan: StepPlan) -> bytes:
        ids = plan.sampling_seq_ids
        alive = [i for i in ids if i not in self.doomed]
        eos = set(self.rng.sample(alive, min(self.finish, len(alive))))
        self.doomed |= eos
        sampled = executor_pb2.SampledTokens(
            seq_ids=ids, token_ids=[EOS if i in eos else self.rng.randrange(1, VOCAB) for i in ids])
        result = executor_pb2.StepResult(step_id=plan.step_id, sampled=sampled, forward_ms=9.5,
                                         step_ms=10.2)
        return result.SerializeToString()


def bench_scheduler(num_seqs: int, seed: int, enable_prefix_caching: bool = False) -> Scheduler:
    """A scheduler of this module's pools and step budget, for up to `num_seqs` seqs."""
    config = SchedulerConfig(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=num_seqs)
    bm = BlockManager(BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS,
                      enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, bm, rng=random.Random(seed))


class Bench:
    """One scheduler with N sequences in decode, driven as the engine drives it."""

    def __init__(self, num_seqs: int, finish_per_step: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.sched = bench_scheduler(num_seqs, seed)
        self.executor = FakeExecutor(random.Random(seed + 1), finish_per_step)
        self.in_flight: deque[tuple[StepPlan, bytes]] = deque()
        self.next_seq_id = 0
        self.prompt_tokens_admitted = 0
        for _ in range(num_seqs):
            self.add_seq()
        self._prefill_all()

    def add_seq(self) -> None:
        prompt = [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(*PROMPT_RANGE))]
        self.next_seq_id += 1
        self.prompt_tokens_admitted += len(prompt)
        self.sched.add_seq(Sequence(
            self.next_seq_id, prompt, SamplingParams(temperature=0.8, top_p=0.95),
            StoppingParams(max_tokens=None), eos_token_id=EOS, max_model_len=MAX_MODEL_LEN,
            arrival_time=float(self.next_seq_id)))

    def _prefill_all(self) -> None:
        """Setup, not measured: one step with an unlimited budget prefills every prompt, so the
        measured steps start in steady decode without decode tokens spent during a ramp."""
        config = self.sched.config
        self.sched.config = dataclasses.replace(config, max_num_batched_tokens=10**9)
        plan = self.sched.schedule()
        self.sched.config = config
        self.in_flight.append((plan, self.executor.result_for(plan)))
        while len(self.in_flight) < STEPS_IN_FLIGHT:
            self.send()
        for _ in range(4):  # a few steps so every sequence has a token in flight
            self.step()
        self.prompt_tokens_admitted = 0

    def send(self) -> tuple[int, int]:
        """Plans and encodes one step; returns (schedule ns, encode ns)."""
        t0 = time.perf_counter_ns()
        plan = self.sched.schedule()
        t1 = time.perf_counter_ns()
        wire.plan_to_proto(plan).SerializeToString()
        t2 = time.perf_counter_ns()
        self.in_flight.append((plan, self.executor.result_for(plan)))
        return t1 - t0, t2 - t1

    def step(self) -> dict[str, int]:
        """Applies the oldest step's result, admits replacements for the finished sequences
        (request arrivals, not timed), then plans and encodes the next step."""
        plan, data = self.in_flight.popleft()
        t0 = time.perf_counter_ns()
        result = wire.result_from_proto(executor_pb2.StepResult.FromString(data))
        t1 = time.perf_counter_ns()
        updates = self.sched.update_from_output(plan, result.sampled)
        t2 = time.perf_counter_ns()
        for update in updates:
            if update.finish_reason is not None:
                self.add_seq()
        schedule_ns, encode_ns = self.send()
        return {"schedule": schedule_ns, "encode": encode_ns, "decode": t1 - t0,
                "update": t2 - t1}


def _summary(values_ns: list[int]) -> dict[str, float]:
    ms = sorted(v / 1e6 for v in values_ns)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))]}


def phase_summaries(samples: list[dict[str, int]], phases: tuple[str, ...]) -> dict:
    """Median and p90 of each phase over the steps `samples` (nanoseconds per phase), and of
    their sum ("sum")."""
    out = {p: _summary([s[p] for s in samples]) for p in phases}
    out["sum"] = _summary([sum(s[p] for p in phases) for s in samples])
    return out


def print_phases(phases: dict) -> None:
    for phase, s in phases.items():
        print(f"  {phase:<9} median {s['median_ms']:7.3f} ms   p90 {s['p90_ms']:7.3f} ms")


def host_bench_parser(doc: str, cases, num_seqs: list[int]) -> argparse.ArgumentParser:
    """The flags of a benchmark of host time per step: --num-seqs, --steps, --cases, --repeat,
    --seed and --json."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--num-seqs", type=int, nargs="+", default=num_seqs)
    p.add_argument("--steps", type=int, default=200, help="measured steps per run")
    p.add_argument("--cases", nargs="+", choices=list(cases), default=list(cases))
    p.add_argument("--repeat", type=int, default=1, help="runs per case, steps pooled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def run_cases(args: argparse.Namespace, run, report, sizes=None) -> None:
    """run(case, num_seqs) for each of --cases at each of `sizes(case)` (else --num-seqs), each
    result printed by `report` as it comes, then all of them written to --json."""
    results = []
    for case in args.cases:
        for n in sizes(case) if sizes else args.num_seqs:
            results.append(run(case, n))
            report(results[-1])
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1))


def run_once(case: str, num_seqs: int, steps: int, seed: int,
             profile: bool = False) -> tuple[list[dict[str, int]], Bench, int]:
    """`steps` measured steps of one fresh Bench: per step, nanoseconds per phase; the Bench;
    the preemptions during those steps (none is expected: the pool is large enough)."""
    bench = Bench(num_seqs, CASES[case], seed)
    preempted_before = _preemptions(bench.sched)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    samples = [bench.step() for _ in range(steps)]
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return samples, bench, _preemptions(bench.sched) - preempted_before


def run_case(case: str, num_seqs: int, steps: int, seed: int, repeat: int = 1,
             profile: bool = False) -> dict:
    """Medians and p90 over the steps of `repeat` runs pooled (the machine is shared: a burst of
    load then hits a part of the samples, not a whole figure); also each run's median sum."""
    samples, run_sums, preemptions = [], [], 0
    for _ in range(repeat):
        run, bench, preempted = run_once(case, num_seqs, steps, seed, profile)
        samples += run
        preemptions += preempted
        run_sums.append(_summary([sum(s.values()) for s in run])["median_ms"])
    phases = phase_summaries(samples, PHASES)
    return {"case": case, "num_seqs": num_seqs, "steps": steps, "repeat": repeat,
            "phases": phases, "run_median_sums_ms": run_sums,
            "running_at_end": bench.sched.num_running,
            "prompt_tokens_per_step": bench.prompt_tokens_admitted / steps,
            "preemptions": preemptions}


def _preemptions(sched: Scheduler) -> int:
    return sched.num_preemptions_swap + sched.num_preemptions_recompute


def _print(result: dict) -> None:
    print(f"\n{result['case']}, N = {result['num_seqs']} ({result['steps']} steps, "
          f"{result['running_at_end']} running at the end, "
          f"{result['prompt_tokens_per_step']:.0f} prompt tokens/step, "
          f"{result['preemptions']} preemptions; median sum per run: "
          f"{', '.join(f'{m:.3f}' for m in result['run_median_sums_ms'])} ms)")
    print_phases(result["phases"])


def main(argv: list[str] | None = None) -> None:
    p = host_bench_parser(__doc__, CASES, [256, 512, 1024])
    p.add_argument("--profile", action="store_true",
                   help="print cProfile's top functions for each case (inflates the times)")
    args = p.parse_args(argv)
    run_cases(args, lambda case, n: run_case(case, n, args.steps, args.seed, args.repeat,
                                             args.profile), _print)


if __name__ == "__main__":
    main()
