"""Hypothesis state machine over the scheduler: random adds (some sharing prompt prefixes, with
prefix caching on or off, some of n parallel samples), steps, aborts (also mid-flight), stop-string finishes and executor
resets, with invariants after every rule (and after every plan: the oldest running seq is never
preempted) and a drain at the end that must free every GPU and CPU block and give every unaborted
seq its exact tokens."""

import functools
import random

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import FinishReason, Sequence
from sched_factories import (Loop, PipelinedLoop, check_queues, default_token, make_samples,
                             make_seq)


class SchedulerMachine(RuleBasedStateMachine):
    LOOP = Loop  # lockstep: each result is applied before the next step is planned

    @initialize(block_size=st.sampled_from([1, 2, 4, 8]), num_gpu_blocks=st.integers(2, 16),
                num_cpu_blocks=st.integers(0, 48), max_num_batched_tokens=st.integers(1, 64),
                max_num_seqs=st.integers(1, 8), chunked=st.booleans(),
                mode=st.sampled_from(["swap", "recompute"]),
                caching=st.sampled_from([True, False]))  # shrinks towards caching on
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, max_num_batched_tokens,
              max_num_seqs, chunked, mode, caching):
        config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                                 preemption_mode=mode, enable_prefix_caching=caching)
        bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks,
                          enable_prefix_caching=caching)
        self.sched = Scheduler(config, bm, rng=random.Random(0))
        self.sched.schedule = self._schedule_keeping_the_oldest
        self.loop = self.LOOP(self.sched)
        self.next_id = 0
        self.expected: dict[int, tuple[int, int]] = {}  # seq_id -> (prompt_len, num outputs)
        self.cut_short: set[int] = set()  # aborted or stopped by "stop string"

    def _schedule_keeping_the_oldest(self):
        """FCFS liveness: the oldest running seq is preempted only when it runs alone."""
        running = self.sched.running
        oldest = running[0].seq_id if len(running) > 1 else None
        plan = Scheduler.schedule(self.sched)
        assert oldest is None or oldest not in plan.preempted_seq_ids, oldest
        return plan

    def _live_id(self, index: int) -> int:
        ids = sorted(self.sched._seqs)
        return ids[index % len(ids)]

    @rule(prompt_len=st.integers(1, 24), max_tokens=st.integers(1, 24),
          extra_len=st.integers(1, 32))
    def add_seq(self, prompt_len, max_tokens, extra_len):
        seq_id = self.next_id
        self._add(make_seq(seq_id, prompt_len, max_tokens, max_model_len=prompt_len + extra_len),
                  max_tokens, extra_len)

    @rule(prefix_id=st.integers(0, 1), prefix_len=st.integers(2, 20), num_seqs=st.integers(1, 4),
          suffix_len=st.integers(0, 6), max_tokens=st.integers(1, 16))
    def add_shared_prefix(self, prefix_id, prefix_len, num_seqs, suffix_len, max_tokens):
        """Prompts that start like others (a system prompt, an earlier turn): prefix hits."""
        for _ in range(num_seqs):
            seq_id = self.next_id
            prompt = ([500 + prefix_id * 50 + i % 40 for i in range(prefix_len)]
                      + [10 + (seq_id * 13 + i) % 400 for i in range(suffix_len)])
            seq = Sequence(seq_id, prompt, SamplingParams(),
                           StoppingParams(max_tokens=max_tokens), eos_token_id=2,
                           max_model_len=len(prompt) + 32, arrival_time=float(seq_id))
            self._add(seq, max_tokens, 32)

    @rule(prompt_len=st.integers(1, 20), n=st.integers(2, 4), max_tokens=st.integers(1, 16))
    def add_parallel(self, prompt_len, n, max_tokens):
        """A request of n samples: prefilled once, then forked from the first sample's pages."""
        seq = make_seq(self.next_id, prompt_len, max_tokens, max_model_len=prompt_len + 32)
        self._add(seq, max_tokens, 32, make_samples(seq, n, self.next_id + 1))

    def _add(self, seq, max_tokens, extra_len, samples=()):
        prompt_len = seq.num_prompt_tokens
        self.next_id += 1 + len(samples)
        if not self.sched.can_ever_fit(prompt_len + 1):
            return  # the engine refuses it before it reaches the scheduler
        self.sched.add_seq(seq, samples)
        bm = self.sched.block_manager
        capacity_len = bm.num_gpu_blocks * bm.block_size + 1
        for s in (seq, *samples):
            self.expected[s.seq_id] = (prompt_len,
                                       min(max_tokens, extra_len, capacity_len - prompt_len))

    @rule(num_seqs=st.integers(2, 6), prompt_len=st.integers(1, 16), max_tokens=st.integers(4, 24))
    def add_batch(self, num_seqs, prompt_len, max_tokens):
        """Several similar requests at once: the usual way to run out of pages."""
        for i in range(num_seqs):
            self.add_seq(prompt_len + i, max_tokens, extra_len=32)

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps):
        for _ in range(num_steps):
            self.loop.step()

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(index=st.integers(0, 1000), mid_flight=st.booleans())
    def abort(self, index, mid_flight):
        seq_id = self._live_id(index)
        self.cut_short.add(seq_id)
        if mid_flight:
            self.loop.step(between=lambda plan: self.sched.abort_seq(seq_id))
        else:
            assert self.sched.abort_seq(seq_id)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(index=st.integers(0, 1000))
    def finish_by_stop_string(self, index):
        seq_id = self._live_id(index)
        self.cut_short.add(seq_id)
        assert self.sched.finish_seq(seq_id, FinishReason.STOP_STRING)

    @rule()
    def reset_executor(self):
        self.loop.reset_executor()

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.block_manager.check_invariants()
            check_queues(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self.loop.run_until_done(max_steps=5000)
        bm = self.sched.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
        assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
        assert not self.sched.running and not self.sched.swapped and not self.sched.waiting
        for seq_id, (prompt_len, num_outputs) in self.expected.items():
            outputs = self.loop.outputs.get(seq_id, [])
            # Preemption, swaps and resets must neither lose, repeat nor change a token.
            assert outputs == [default_token(seq_id, prompt_len + k) for k in range(len(outputs))]
            if seq_id not in self.cut_short:
                assert len(outputs) == num_outputs, (seq_id, outputs, num_outputs)
                assert self.loop.finished[seq_id] is FinishReason.LENGTH


class PipelinedSchedulerMachine(SchedulerMachine):
    """The same rules with two steps in flight (async scheduling): aborts, stop-string finishes
    and resets land while the executor is a step ahead of the scheduler."""
    LOOP = PipelinedLoop


class ThreeInFlightSchedulerMachine(SchedulerMachine):
    """The same rules with three steps in flight (`--max-steps-in-flight 3`): a seq may have two
    tokens pending when it is aborted, finished, preempted or reset."""
    LOOP = functools.partial(PipelinedLoop, depth=3)


_SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None, derandomize=True)
SchedulerMachine.TestCase.settings = _SETTINGS
PipelinedSchedulerMachine.TestCase.settings = _SETTINGS
ThreeInFlightSchedulerMachine.TestCase.settings = _SETTINGS
TestSchedulerMachine = SchedulerMachine.TestCase
TestPipelinedSchedulerMachine = PipelinedSchedulerMachine.TestCase
TestThreeInFlightSchedulerMachine = ThreeInFlightSchedulerMachine.TestCase
