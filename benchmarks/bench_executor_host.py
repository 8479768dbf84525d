"""The executor's host cost per step on the CPU (issue 10), the model forward and sampling kernels
excepted: the plan parsed (`StepPlan.FromString` + `wire.plan_from_proto`), `ModelRunner.launch`
(checks, state updates, inputs built, the decode graph's inputs packed), `ModelRunner.finish`
and the result encoded (`wire.result_to_proto` + `SerializeToString`), at N running sequences.
Plain Python: no GPU, no gRPC server, no network.

    python -m benchmarks.bench_executor_host --num-seqs 256 1024 --steps 200 --json out.json

The plans are the real Scheduler's (sized as in bench_scheduler: block size 16, 54,000 GPU
blocks, 8192-token steps, max_num_seqs = N, prompts 64-1,024 tokens, greedy as in W2 unless
--temperature is given), encoded
with scheduler_svc's wire.plan_to_proto, two steps in flight as the servicer runs them: step k+1
is launched before step k is finished. The runner has a fake model (forward and logits return
tiny tensors), a fake sampler (random ids) and a fake cache engine; decode steps go through
CudaGraphs' decode ladder with a replay that does nothing, as the GPU runner replays graphs.
Time spent in the fakes is subtracted from launch. Cases:
  decode  N sequences in steady decode.
  mixed   as decode, but 2 sequences finish (EOS) and 2 new ones are admitted each step, their
          whole prompts prefilled in that step (an eager step, as in W2).
  prefix  issue 12's cached-prefix request, one at a time (N is ignored): each step admits one
          seq of a 2,000-token cached prefix + 16 new tokens (2,000 computed, 16 scheduled, a
          126-page table), max_tokens 1, run through the small-step ladder with a replay that does
          nothing; the seq finishes with its one token and is dropped by the next plan. One
          step in flight, as bench_ttft's sequential requests. Also reported: to_replay, the
          part of launch before the graph's replay is queued (on the GPU, the idle part).
The scheduler's own work (schedule, update_from_output, plan encoding) is not timed.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections import deque
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_scheduler import (BLOCK_SIZE, MAX_MODEL_LEN,  # noqa: E402
                                        NUM_CPU_BLOCKS, NUM_GPU_BLOCKS, PROMPT_RANGE, _summary,
                                        bench_scheduler, host_bench_parser, phase_summaries,
                                        print_phases, run_cases)
from executor_svc import wire  # noqa: E402
from executor_svc.cuda_graphs import TOKEN_SIZES, CudaGraphs  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from executor_svc.step import ExecutorInfo  # noqa: E402
from protos import executor_pb2  # noqa: E402
from scheduler_svc import wire as scheduler_wire  # noqa: E402
from scheduler_svc.sampling_params import SamplingParams, StoppingParams  # noqa: E402
from scheduler_svc.sequence import Sequence  # noqa: E402

VOCAB, EOS = 128_256, 128_001  # Llama-3
CASES = {"decode": 0, "mixed": 2, "prefix": 0}  # name: seqs finished and admitted per step
PREFIX_TOKENS, NEW_TOKENS = 2000, 16  # the prefix case's requests (bench_ttft's defaults)
PHASES = ("parse", "launch", "finish", "encode")
STEPS_IN_FLIGHT = 2


class Fakes:
    """The model, sampler and cache engine: tensors of the right shapes, nothing computed. Their
    time is counted in `ns`, to be taken out of the phase that called them."""

    def __init__(self, seed: int) -> None:
        self.ns = 0
        self.replayed: tuple[int, int] | None = None  # (perf_counter_ns, ns) at the last replay
        self.config = dataclasses.make_dataclass("Config", [("vocab_size", int)])(1)
        self.generator = torch.Generator().manual_seed(seed)
        self.kv_caches = (torch.zeros(1, 1, 1, BLOCK_SIZE, 1),) * 2  # shape[3]: block size

    def forward(self, input_ids, positions, metadata, kv_caches) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        hidden = torch.zeros(len(input_ids), 1)  # [num_tokens, 1]
        self.ns += time.perf_counter_ns() - t0
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out=None) -> torch.Tensor:
        return hidden if out is None else out  # [n, 1]

    def sample(self, logits: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter_ns()
        n = logits.shape[0]
        token_ids = torch.randint(1, EOS, (n,), generator=self.generator)  # [n] int64
        logprobs = torch.zeros(n)  # [n] float32
        self.ns += time.perf_counter_ns() - t0
        return token_ids, logprobs

    def swap_out(self, pairs) -> None:
        assert not pairs, "the pool is sized so that nothing is preempted"

    swap_in = copy = swap_out


class _NoReplay:
    def __init__(self, fakes: Fakes) -> None:
        self.fakes = fakes

    def replay(self) -> None:
        """Notes when (and after how much time in fakes) the graph would have been queued."""
        self.fakes.replayed = (time.perf_counter_ns(), self.fakes.ns)


def make_runner(fakes: Fakes, small_steps: bool = False) -> ModelRunner:
    """A runner with the fakes, and decode graphs (and, if `small_steps`, small-step graphs)
    whose replays do nothing: the inputs are packed and staged as on the GPU."""
    info = ExecutorInfo("bench", "fp", "bfloat16", BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS,
                        MAX_MODEL_LEN, VOCAB, "", "cpu")
    backend = dataclasses.make_dataclass("Backend", [("device", torch.device)])(
        torch.device("cpu"))
    max_blocks_per_seq = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    graphs = CudaGraphs(fakes, fakes.kv_caches, max_blocks_per_seq,
                        token_sizes=TOKEN_SIZES if small_steps else ())
    runner = ModelRunner(fakes, backend, fakes, info, graphs)
    graphs.prepare(runner.input_batch.token_counts)
    graphs.graphs = {key: _NoReplay(fakes) for key in graphs.keys()}
    runner.sampler = fakes
    return runner


class Bench:
    """The real scheduler feeding one runner, as the servicer drives it."""

    def __init__(self, num_seqs: int, finish_per_step: int, seed: int,
                 temperature: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
        self.finish_per_step = finish_per_step
        self.sched = bench_scheduler(num_seqs, seed)
        self.fakes = Fakes(seed)
        self.runner = make_runner(self.fakes)
        self.in_flight: deque = deque()  # (scheduler plan, PendingStep)
        self.step_id = 0
        self.next_seq_id = 0
        self.doomed: set[int] = set()  # seqs given EOS
        self.kinds: dict[str, int] = {"decode": 0, "other": 0}
        for _ in range(num_seqs):
            self.add_seq()
        self._prefill_all()

    def add_seq(self) -> None:
        prompt = [self.rng.randrange(1, EOS) for _ in range(self.rng.randint(*PROMPT_RANGE))]
        self.next_seq_id += 1
        self.sched.add_seq(Sequence(
            self.next_seq_id, prompt, self.sampling, StoppingParams(max_tokens=None), eos_token_id=EOS,
            max_model_len=MAX_MODEL_LEN, arrival_time=float(self.next_seq_id)))

    def _prefill_all(self) -> None:
        """Setup, not measured: one step with an unlimited budget prefills every prompt."""
        config = self.sched.config
        self.sched.config = dataclasses.replace(config, max_num_batched_tokens=10**9)
        self.send()
        self.sched.config = config
        while len(self.in_flight) < STEPS_IN_FLIGHT:
            self.send()
        for _ in range(4):
            self.step()
        self.kinds = {"decode": 0, "other": 0}

    def send(self) -> tuple[int, int]:
        """Plans and encodes the next step (not timed); the executor parses and launches it.
        Returns (parse ns, launch ns)."""
        plan = self.sched.schedule()
        assert not plan.is_empty
        self.step_id += 1
        message = scheduler_wire.plan_to_proto(plan)
        message.step_id = self.step_id  # the scheduler numbers empty plans too
        data = message.SerializeToString()
        t0 = time.perf_counter_ns()
        step = wire.plan_from_proto(executor_pb2.StepPlan.FromString(data))
        t1 = time.perf_counter_ns()
        fake_ns = self.fakes.ns
        self.fakes.replayed = None
        pending = self.runner.launch(step)
        t2 = time.perf_counter_ns()
        self.kinds[pending.kind] += 1
        self.in_flight.append((plan, pending))
        if self.fakes.replayed is not None:  # launch's host time before its graph is queued
            replay_ns, replay_fake_ns = self.fakes.replayed
            self.to_replay_ns = replay_ns - t1 - (replay_fake_ns - fake_ns)
        return t1 - t0, t2 - t1 - (self.fakes.ns - fake_ns)

    def step(self) -> dict[str, int]:
        """Finishes the oldest step and encodes its result; the scheduler applies it (not
        timed), admits replacements and plans the next step, which is parsed and launched."""
        plan, sampled, finish_ns, encode_ns = self.finish_oldest()
        alive = [i for i in sampled if i not in self.doomed]
        for seq_id in self.rng.sample(alive, min(self.finish_per_step, len(alive))):
            sampled[seq_id] = EOS
            self.doomed.add(seq_id)
        for update in self.sched.update_from_output(plan, sampled):
            if update.finish_reason is not None:
                self.add_seq()
        parse_ns, launch_ns = self.send()
        return {"parse": parse_ns, "launch": launch_ns, "finish": finish_ns, "encode": encode_ns}

    def finish_oldest(self) -> tuple:
        """Finishes the oldest step and encodes its result (timed), then decodes it as the
        scheduler does (not timed): (plan, sampled, finish ns, encode ns)."""
        plan, pending = self.in_flight.popleft()
        t0 = time.perf_counter_ns()
        result = self.runner.finish(pending)
        t1 = time.perf_counter_ns()
        data = wire.result_to_proto(result).SerializeToString()
        t2 = time.perf_counter_ns()
        sampled = scheduler_wire.result_from_proto(executor_pb2.StepResult.FromString(data)).sampled
        return plan, sampled, t1 - t0, t2 - t1


class PrefixBench(Bench):
    """The prefix case: one request at a time, each a cached 2,000-token prefix + 16 new tokens
    with max_tokens 1, so each step is one new seq of 2,000 computed and 16 scheduled tokens."""

    def __init__(self, num_seqs: int, finish_per_step: int, seed: int,
                 temperature: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
        self.sched = bench_scheduler(16, seed, enable_prefix_caching=True)
        self.fakes = Fakes(seed)
        self.runner = make_runner(self.fakes, small_steps=True)
        self.in_flight = deque()
        self.step_id = self.next_seq_id = 0
        self.kinds = {"decode": 0, "other": 0}
        self.prefix = [self.rng.randrange(1, EOS) for _ in range(PREFIX_TOKENS)]
        self.add_seq(self.prefix)  # setup, not measured: computes and caches the prefix
        self.send()
        for _ in range(4):
            self.step()
        self.kinds = {"decode": 0, "other": 0}

    def add_seq(self, prompt: list[int] | None = None) -> None:
        if prompt is None:
            prompt = self.prefix + [self.rng.randrange(1, EOS) for _ in range(NEW_TOKENS)]
        self.next_seq_id += 1
        self.sched.add_seq(Sequence(
            self.next_seq_id, prompt, self.sampling, StoppingParams(max_tokens=1),
            eos_token_id=EOS, max_model_len=MAX_MODEL_LEN, arrival_time=float(self.next_seq_id)))

    def step(self) -> dict[str, int]:
        """Finishes the step in flight and encodes its result; the scheduler applies it and
        drops the seq (not timed); the next request is admitted, planned (not timed), parsed and
        launched."""
        plan, sampled, finish_ns, encode_ns = self.finish_oldest()
        for update in self.sched.update_from_output(plan, sampled):
            assert update.finish_reason is not None, "max_tokens 1: every seq finishes"
        self.add_seq()
        parse_ns, launch_ns = self.send()
        return {"parse": parse_ns, "launch": launch_ns, "finish": finish_ns, "encode": encode_ns,
                "to_replay": self.to_replay_ns}


def run_case(case: str, num_seqs: int, steps: int, seed: int, repeat: int = 1,
             temperature: float = 0.0) -> dict:
    """Medians and p90 over the steps of `repeat` fresh runs pooled; each run's median sum."""
    samples, run_sums, kinds = [], [], {"decode": 0, "other": 0}
    for _ in range(repeat):
        bench = (PrefixBench if case == "prefix" else Bench)(num_seqs, CASES[case], seed,
                                                              temperature)
        run = [bench.step() for _ in range(steps)]
        samples += run
        run_sums.append(_summary([sum(s[p] for p in PHASES) for s in run])["median_ms"])
        kinds = {k: kinds[k] + v for k, v in bench.kinds.items()}
    phases = phase_summaries(samples, PHASES)
    if case == "prefix":  # part of launch: with nothing else queued, the GPU idles through it
        phases["to_replay"] = _summary([s["to_replay"] for s in samples])
    return {"case": case, "num_seqs": num_seqs, "steps": steps, "repeat": repeat,
            "temperature": temperature,
            "phases": phases, "run_median_sums_ms": run_sums, "step_kinds": kinds,
            "running_at_end": bench.sched.num_running}


def _print(result: dict) -> None:
    print(f"\n{result['case']}, N = {result['num_seqs']} ({result['steps']} steps x "
          f"{result['repeat']}, {result['running_at_end']} running at the end, step kinds "
          f"{result['step_kinds']}; median sum per run: "
          f"{', '.join(f'{m:.3f}' for m in result['run_median_sums_ms'])} ms)")
    print_phases(result["phases"])


def main(argv: list[str] | None = None) -> None:
    p = host_bench_parser(__doc__, CASES, [256, 1024])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's (top_p 0.95 when > 0); default greedy, as W2")
    args = p.parse_args(argv)
    # What the GPU runner queues as device copies runs here as CPU copies; with torch's two
    # intra-op threads on a shared 2-core VM each one waits for the other core (7 ms at 1,024
    # seqs instead of 0.05).
    torch.set_num_threads(1)
    run_cases(args, lambda case, n: run_case(case, n, args.steps, args.seed, args.repeat,
                                             args.temperature), _print,
              sizes=lambda case: [1] if case == "prefix" else args.num_seqs)  # prefix: one seq


if __name__ == "__main__":
    main()
