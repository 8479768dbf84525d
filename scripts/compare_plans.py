"""Plan-by-plan comparison of two trees' schedulers on the same random runs, to show that a
restructuring changed no decision. Each tree runs in a process of its own (both are the package
`scheduler_svc`) and writes one line per step: the plan (copies, new and cached seqs with their
block tables, finishes, preemptions, sampling seqs) and the tokens and finishes it produced. The
first differing step of each run is printed with both sides.

    git archive 4a72081 | tar -x -C /tmp/old
    python scripts/compare_plans.py /tmp/old --runs 300
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EOS = 2


def run_config(rng: random.Random) -> dict:
    """A small cache and step budget, so that runs preempt (both modes), chunk prompts and hit
    cached prefixes."""
    return dict(block_size=rng.choice([1, 2, 4, 8, 16]), num_gpu_blocks=rng.randint(4, 48),
                num_cpu_blocks=rng.choice([0, 8, 32, 64]),
                max_num_batched_tokens=rng.choice([8, 16, 32, 64, 256]),
                max_num_seqs=rng.randint(1, 12), enable_chunked_prefill=rng.random() < 0.8,
                preemption_mode=rng.choice(["swap", "recompute"]),
                enable_prefix_caching=rng.random() < 0.7)


def token_for(seq_id: int, position: int) -> int:
    """A seeded sampler's stand-in: fixed per (seq, position), EOS now and then."""
    h = (seq_id * 7919 + position * 104729) % 1009
    return EOS if h < 25 else 100 + h


def emit_runs(tree: Path, runs: int, first_seed: int, max_steps: int) -> None:
    """Child side: drive `tree`'s scheduler and print one JSON line per step."""
    sys.path.insert(0, str(tree))
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.scheduler import Scheduler

    for seed in range(first_seed, first_seed + runs):
        rng = random.Random(seed)
        cfg = run_config(rng)
        bm = BlockManager(cfg["block_size"], cfg["num_gpu_blocks"], cfg["num_cpu_blocks"],
                          enable_prefix_caching=cfg["enable_prefix_caching"], cache_salt="cmp")
        config = SchedulerConfig(**{k: v for k, v in cfg.items()
                                    if k not in ("block_size", "num_gpu_blocks", "num_cpu_blocks")})
        sched = Scheduler(config, bm, rng=random.Random(seed))
        _drive(sched, rng, seed, max_steps)


def _drive(sched, rng: random.Random, seed: int, max_steps: int) -> None:
    next_id, adding_steps = 0, rng.randint(5, 60)
    for step in range(max_steps):
        events = []
        if step < adding_steps:
            next_id = _add_requests(sched, rng, next_id, events)
        _interrupt(sched, rng, events)
        if step >= adding_steps and not sched.has_unfinished():
            break
        plan = sched.schedule()
        sampled = {s: token_for(s, len(sched.get_seq(s).token_ids))
                   for s in plan.sampling_seq_ids}
        updates = sched.update_from_output(plan, sampled)
        line = dict(seed=seed, step=step, events=events, plan=_plan_dict(plan),
                    updates=[(u.seq.seq_id, u.token_id,
                              None if u.finish_reason is None else str(u.finish_reason))
                             for u in updates])
        print(json.dumps(line, separators=(",", ":")))


def _add_requests(sched, rng: random.Random, next_id: int, events: list) -> int:
    from scheduler_svc.sampling_params import SamplingParams, StoppingParams
    from scheduler_svc.sequence import Sequence

    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        prefix = [500 + rng.randint(0, 1) * 50 + i for i in range(rng.choice([0, 0, 8, 20]))]
        prompt = prefix + [10 + rng.randrange(400) for _ in range(rng.randint(1, 24))]
        max_tokens, n = rng.randint(1, 24), rng.choice([1, 1, 1, 2, 3])
        ids = list(range(next_id, next_id + n))
        next_id += n
        seqs = [Sequence(i, prompt, SamplingParams(), StoppingParams(max_tokens=max_tokens),
                         eos_token_id=EOS, max_model_len=len(prompt) + 32,
                         arrival_time=float(ids[0])) for i in ids]
        if not sched.can_ever_fit(len(prompt) + 1):
            events.append(["unfit", ids[0]])  # the engine refuses these before the scheduler
            continue
        sched.add_seq(seqs[0], seqs[1:])
        events.append(["add", ids, len(prompt), max_tokens])
    return next_id


def _interrupt(sched, rng: random.Random, events: list) -> None:
    """Now and then a client abort or a stop-string finish of a live seq."""
    live = sorted(s.seq_id for s in list(sched.running) + list(sched.waiting))
    if live and rng.random() < 0.05:
        seq_id = rng.choice(live)
        events.append(["abort", seq_id, sched.abort_seq(seq_id)])
    if sched.running and rng.random() < 0.05:
        from scheduler_svc.sequence import FinishReason
        seq_id = rng.choice([s.seq_id for s in sched.running])
        events.append(["stop", seq_id, sched.finish_seq(seq_id, FinishReason.STOP_STRING)])


def _plan_dict(plan) -> dict:
    c = plan.cached_seqs
    return dict(swap_out=plan.swap_out, swap_in=plan.swap_in, copy=plan.copy,
                new=[(s.seq_id, s.token_ids, s.block_table, s.num_computed_tokens,
                      s.num_scheduled_tokens, s.num_prompt_tokens) for s in plan.new_seqs],
                cached=[c.seq_ids, c.num_scheduled_tokens, c.num_computed_tokens,
                        c.num_new_blocks, c.new_block_ids],
                finished=plan.finished_seq_ids, preempted=plan.preempted_seq_ids,
                sampling=plan.sampling_seq_ids)


def trace(tree: Path, runs: int, first_seed: int, max_steps: int) -> dict[int, list[str]]:
    """seed -> its step lines, from a child process running `tree`'s scheduler."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--emit", str(tree), "--runs",
           str(runs), "--first-seed", str(first_seed), "--max-steps", str(max_steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the driver failed:\n{out.stderr[-3000:]}")
    by_seed: dict[int, list[str]] = {}
    for line in out.stdout.splitlines():
        by_seed.setdefault(json.loads(line)["seed"], []).append(line)
    return by_seed


def compare(old: dict[int, list[str]], new: dict[int, list[str]]) -> tuple[list[str], Counter]:
    """The first difference of each differing run, and what the runs exercised."""
    diffs, seen = [], Counter()
    for seed in sorted(set(old) | set(new)):
        a, b = old.get(seed, []), new.get(seed, [])
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        if first is not None:
            diffs.append(f"seed {seed}, step {first}:\n  old {a[first] if first < len(a) else '<end>'}"
                         f"\n  new {b[first] if first < len(b) else '<end>'}")
        for line in b:
            _count(json.loads(line), seen)
    return diffs, seen


def _count(line: dict, seen: Counter) -> None:
    plan = line["plan"]
    seen["steps"] += 1
    seen["preemptions"] += len(plan["preempted"])
    seen["pages swapped out"] += len(plan["swap_out"])
    seen["pages copied (fork)"] += len(plan["copy"])
    seen["new seqs starting on cached pages"] += sum(1 for s in plan["new"] if s[3] > 0)
    seen["aborts and stop-string finishes"] += sum(1 for e in line["events"]
                                                   if e[0] in ("abort", "stop"))
    seen["tokens"] += len(line["updates"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path, help="the other tree (e.g. a git archive of a commit)")
    p.add_argument("new", type=Path, nargs="?", default=ROOT)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.emit:
        emit_runs(args.old, args.runs, args.first_seed, args.max_steps)
        return
    old = trace(args.old.resolve(), args.runs, args.first_seed, args.max_steps)
    new = trace(args.new.resolve(), args.runs, args.first_seed, args.max_steps)
    diffs, seen = compare(old, new)
    print(f"{args.runs} runs: {args.runs - len(diffs)} identical plan by plan, "
          f"{len(diffs)} differ; the new tree's runs had " + ", ".join(
              f"{v} {k}" for k, v in seen.items()))
    for d in diffs[:5]:
        print(d)
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
