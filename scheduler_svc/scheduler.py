"""The scheduling policy (vLLM v1 rule): each step hands out tokens from a budget so that every
sequence's num_computed_tokens catches up with its num_tokens; preemption by swap or recompute;
token-level stop rules. Plain Python: never imports torch, cupy, pagedserve_kernels, executor_svc or
gRPC."""

import bisect
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.drain_rate import DrainRate
from scheduler_svc.errors import ExecutorDisagreement
from scheduler_svc.plan import NewSeqPlan, SeqUpdate, StepPlan
from scheduler_svc.scheduler_stats import SchedulerStats
from scheduler_svc.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class _Budget:
    """What is left of this step's max_num_batched_tokens, and the step's _pool_len_cap()."""

    tokens: int
    len_cap: int


def _age(seq: Sequence) -> tuple[float, int]:
    return seq.sort_key


class Scheduler:
    """Owns the queues (waiting FCFS, running and swapped oldest first) and builds StepPlans.

    Call `schedule()`, send the plan, and apply its result with `update_from_output(plan,
    sampled)`. Later plans may be scheduled before that result is back (the engine keeps up to
    max_steps_in_flight out; a token still to be sampled counts as pending); results are applied
    in step order. Pages are reclaimed in the same call that finishes or aborts a sequence.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_manager = block_manager
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        # How fast waiting seqs start: admission refuses a request the queue would starve.
        self._drain = DrainRate()
        self._num_started = 0  # seqs taken off the waiting queue (or forked) this pass
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._executor_seq_ids: set[int] = set()  # seqs whose state the executor holds
        self._pending_finished_ids: list[int] = []
        self._step_id = 0
        self._last_updated_step_id = 0  # plans at or below this are stale (updated or reset)
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_blocks_swapped_out = 0  # pages copied to the CPU
        self.num_blocks_swapped_in = 0  # pages copied back to the GPU
        # Pages a swap found on the other device already (shared there, not copied).
        self.num_blocks_swap_shared_out = 0
        self.num_blocks_swap_shared_in = 0
        self.peak_gpu_blocks_used = 0
        # Prefix caching: tokens of the seqs admitted from scratch, and those found cached.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        self.num_blocks_copied = 0
        # Seqs with pages that may have become full since they were last offered to the cache;
        # offered at the next schedule(), when the steps that write their KV have been sent.
        self._seqs_to_cache: set[int] = set()
        # Parallel sampling: the samples of a request wait here, under the seq_id of its first
        # sample, until that one's prompt KV is written; then each forks from its pages.
        self._forks: dict[int, list[Sequence]] = {}
        self._fork_parent: dict[int, int] = {}  # sample's seq_id -> the seq it forks from

    # ---- requests ----------------------------------------------------------------------------

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether KV for num_tokens tokens fits in the whole GPU pool: the engine admits only a
        request whose prompt plus its first (or its max_tokens) output tokens can."""
        bm = self.block_manager
        return bm.num_blocks_needed(num_tokens) <= bm.num_gpu_blocks

    def add_seq(self, seq: Sequence, samples: list[Sequence] = ()) -> None:
        """Queue a new request (FCFS); assigns a seed to each seq that has none.

        `samples`: the request's other samples (parallel sampling, same prompt). They are
        prefilled once, by `seq`: once its prompt's KV is written, each sample forks from its
        pages (fork_prompt) and computes only the last prompt token, to sample its own first
        token. If `seq` finishes before they fork, they are queued as requests of their own.
        The caller has checked can_ever_fit: a seq that can never fit would wait forever."""
        for s in (seq, *samples):
            if s.seq_id in self._seqs:
                raise ValueError(f"seq {s.seq_id} already added")
            if s.prompt_token_ids != seq.prompt_token_ids:
                raise ValueError(f"seq {s.seq_id}: a sample must have its request's prompt")
        for s in (seq, *samples):
            if s.seed is None:
                s.seed = self._rng.randrange(2**63)
            s.status = SequenceStatus.WAITING
            self._seqs[s.seq_id] = s
        self.waiting.append(seq)
        if samples:
            self._forks[seq.seq_id] = list(samples)
            for s in samples:
                self._fork_parent[s.seq_id] = seq.seq_id

    def abort_seq(self, seq_id: int) -> bool:
        """Client went away: free its pages now. False if unknown or already finished."""
        return self.finish_seq(seq_id, FinishReason.ABORTED)

    def finish_seq(self, seq_id: int, reason: FinishReason) -> bool:
        """Finish from outside (stop string, abort): free its pages now; the executor hears of it
        in the next plan's finished_seq_ids. False if unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        parent_id = self._fork_parent.pop(seq_id, None)
        if parent_id is None:
            self._queue_of(seq).remove(seq)
        else:  # a sample not forked yet
            self._forks[parent_id].remove(seq)
            if not self._forks[parent_id]:
                del self._forks[parent_id]
        self._finish(seq, reason)
        return True

    def get_seq(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to start: queued ones, and samples waiting to fork from their
        request's first sample (what admission bounds)."""
        return len(self.waiting) + len(self._fork_parent)

    def drain_rate(self) -> float | None:
        """Waiting sequences started per second while some waited; None until measured."""
        return self._drain.rate()

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Build the next step: running seqs first, then swap-ins, then waiting admissions."""
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, finished_seq_ids=self._pending_finished_ids)
        self._pending_finished_ids = []
        if self._seqs_to_cache:
            self._cache_full_blocks()
        # Read before this plan schedules anything: their prompt KV is written by plans sent.
        forkable = self._forkable() if self._forks else []
        budget = _Budget(self.config.max_num_batched_tokens, self._pool_len_cap())
        self._schedule_running(plan, budget)
        # After a preemption, bringing seqs in would thrash; after a swap-out, a swap-in could
        # make one block both a source and a destination of this step's copies.
        if not plan.preempted_seq_ids:
            self._schedule_swapped(plan, budget)
        if not plan.preempted_seq_ids and not self.swapped:
            if forkable:
                self._schedule_forks(forkable, plan, budget)
            self._schedule_waiting(plan, budget)
        self.num_blocks_copied += len(plan.copy)
        self.peak_gpu_blocks_used = max(self.peak_gpu_blocks_used,
                                        self.block_manager.num_used_gpu_blocks)
        if plan.is_empty:  # never sent: the next plan takes its id, so the executor sees no gap
            self._step_id -= 1
        self._drain.observe(self._clock(), self._num_started, self.num_waiting)
        self._num_started = 0
        return plan

    def _cache_full_blocks(self) -> None:
        """Offer the full pages of the seqs marked since the last step to the prefix cache: the
        pages of their first min(num_computed_tokens, num_tokens) tokens, whose KV the plans
        already sent write before any later plan runs, and whose token ids are known. A seq
        stays marked while a full page of known tokens still waits for its KV."""
        bm, still, page = self.block_manager, set(), self.block_manager.block_size
        for seq_id in self._seqs_to_cache:
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            num_written = min(seq.num_computed_tokens, seq.num_tokens)
            bm.cache_full_blocks(seq_id, seq.token_ids, num_written)
            if seq.num_tokens // page > num_written // page:
                still.add(seq_id)
        self._seqs_to_cache = still

    def _offer_to_cache(self, seq: Sequence) -> None:
        """Before seq's pages are released: its full pages written by plans already made (and
        so sent before any later plan), which the next schedule() would not see any more."""
        if seq.seq_id in self._seqs_to_cache:
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids,
                                                 min(seq.num_computed_tokens, seq.num_tokens))

    def _schedule_running(self, plan: StepPlan, budget: _Budget) -> None:
        """Oldest first, each to catch up with its tokens, those a step in flight will sample
        included (the executor feeds them itself), but not past the point where the seq is
        certain to stop. A seq short of pages preempts others (maybe itself: _victim).
        The executor knows every running seq: each goes as a diff (its table only grows).
        Every running seq passes here every step, so the loop binds its calls once."""
        running, allocate, advance = self.running, self.block_manager.allocate_slots, self._advance
        cached, cap, tokens, i = plan.cached_seqs, budget.len_cap, budget.tokens, 0
        add_seq_id, add_num_scheduled = cached.seq_ids.append, cached.num_scheduled_tokens.append
        add_num_computed, add_num_blocks = (cached.num_computed_tokens.append,
                                            cached.num_new_blocks.append)
        page = self.block_manager.block_size if self.block_manager.enable_prefix_caching else 0
        while i < len(running) and tokens > 0:
            seq = running[i]
            i += 1
            pending = seq.num_pending_tokens
            total = len(seq.token_ids) + pending
            if pending and (total >= seq.length_limit or total >= cap):
                continue  # the tokens in flight take it to a length limit
            num_computed = seq.num_computed_tokens
            num_new = total - num_computed
            if num_new > tokens:
                num_new = self._chunk(num_new, tokens)
            if not num_new:
                continue
            seq_id = seq.seq_id
            new_block_ids = allocate(seq_id, num_computed + num_new)
            if new_block_ids is None:
                new_block_ids, tokens_back = self._preempt_until_fits(seq, num_new, plan)
                tokens += tokens_back
                # Victims may have stood before seq: find where the loop stands now.
                i = bisect.bisect_left(running, seq.sort_key, key=_age)
                if new_block_ids is None:
                    continue  # seq preempted itself; those after it may still fit
                i += 1
            tokens -= num_new
            add_seq_id(seq_id)  # CachedSeqs.append, bound once
            add_num_scheduled(num_new)
            add_num_computed(num_computed)
            add_num_blocks(len(new_block_ids))
            if new_block_ids:
                cached.new_block_ids.extend(new_block_ids)
            advance(seq, num_new, plan)
            # The prefix cache looks again at a seq whose written pages of known tokens grow.
            if page and min(num_computed + num_new, len(seq.token_ids)) // page > \
                    num_computed // page:
                self._seqs_to_cache.add(seq_id)
        budget.tokens = tokens

    def _preempt_until_fits(self, seq: Sequence, num_new: int,
                            plan: StepPlan) -> tuple[list[int] | None, int]:
        """New block ids for seq (None when seq itself was preempted), preempting a _victim at a
        time until they fit, and the budget tokens that victims scheduled earlier in this plan
        give back."""
        tokens_back = 0
        while True:
            victim = self._victim()
            tokens_back += self._unschedule(victim, plan)
            self._preempt(victim, plan)
            if victim is seq:
                return None, tokens_back
            new_block_ids = self.block_manager.allocate_slots(
                seq.seq_id, seq.num_computed_tokens + num_new)
            if new_block_ids is not None:
                return new_block_ids, tokens_back

    def _victim(self) -> Sequence:
        """The running seq to preempt. Never the oldest unless it runs alone: it always
        progresses, so every seq finishes in turn (no livelock). Among the others, the newest
        seq of the request holding the most distinct GPU pages (a request's samples, which share
        their prompt's pages, counted together), ties to the newest request: whoever holds the
        pool pays for it, not a small newcomer. The samples of a request share its arrival time
        (admission gives them one), which groups them here."""
        running = self.running
        if len(running) == 1:
            return running[0]
        requests: dict[float, list[Sequence]] = {}
        for seq in running[1:]:
            requests.setdefault(seq.arrival_time, []).append(seq)
        table_of = self.block_manager.get_block_table

        def num_pages(seqs: list[Sequence]) -> int:
            if len(seqs) == 1:  # most requests: no set to build
                return len(table_of(seqs[0].seq_id))
            return len(set().union(*(table_of(seq.seq_id) for seq in seqs)))

        arrival = max(requests, key=lambda t: (num_pages(requests[t]), t))
        return requests[arrival][-1]

    @staticmethod
    def _unschedule(seq: Sequence, plan: StepPlan) -> int:
        """Takes seq, about to be preempted, back out of the plan being built if it was
        scheduled there; returns its scheduled tokens. The pages allocated for them stay in its
        table, released or moved with it."""
        cached = plan.cached_seqs
        try:
            k = cached.seq_ids.index(seq.seq_id)
        except ValueError:
            return 0
        start = sum(cached.num_new_blocks[:k])
        del cached.new_block_ids[start:start + cached.num_new_blocks[k]]
        num_new = cached.num_scheduled_tokens[k]
        for column in (cached.seq_ids, cached.num_scheduled_tokens, cached.num_computed_tokens,
                       cached.num_new_blocks):
            del column[k]
        seq.num_computed_tokens -= num_new
        if seq.seq_id in plan.sampling_seq_ids:
            plan.sampling_seq_ids.remove(seq.seq_id)
            seq.num_pending_tokens -= 1
        return num_new

    def _schedule_swapped(self, plan: StepPlan, budget: _Budget) -> None:
        """Swap in oldest first while the pages (and the next tokens) fit; pages still on the
        GPU (held by another seq, or cached) are taken there rather than copied."""
        bm = self.block_manager
        while self.swapped and budget.tokens > 0 and self._has_seq_room():
            seq = self.swapped[0]
            num_new = self._num_new_tokens(seq, budget)
            num_total = seq.num_computed_tokens + num_new
            if num_new == 0 or not bm.can_swap_in(seq.seq_id, num_total):
                return
            num_pages = len(bm.get_cpu_block_table(seq.seq_id))
            pairs = bm.swap_in(seq.seq_id)
            plan.swap_in.extend(pairs)
            self.num_blocks_swapped_in += len(pairs)
            self.num_blocks_swap_shared_in += num_pages - len(pairs)
            new_block_ids = bm.allocate_slots(seq.seq_id, num_total)
            assert new_block_ids is not None, "swap-in fit was checked"
            self.swapped.pop(0)
            self._set_running(seq)
            budget.tokens -= num_new
            self._send_in_full(seq, num_new, plan)

    def _schedule_waiting(self, plan: StepPlan, budget: _Budget) -> None:
        """Admit FCFS (recompute-preempted seqs sit at the front) while pages fit."""
        bm = self.block_manager
        while self.waiting and budget.tokens > 0 and self._has_seq_room():
            seq = self.waiting[0]
            cached_block_ids = (bm.find_cached_prefix(seq.seq_id, seq.token_ids)
                                if not seq.num_pending_tokens else [])
            seq.num_computed_tokens = len(cached_block_ids) * bm.block_size
            num_new = self._num_new_tokens(seq, budget)
            new_block_ids = (bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                               cached_block_ids)
                             if num_new else None)
            if new_block_ids is None:
                seq.num_computed_tokens = 0  # waiting seqs own no pages
                return
            self.num_prefix_cache_queries += seq.num_tokens
            self.num_prefix_cache_hits += seq.num_computed_tokens
            self.waiting.popleft()
            self._num_started += 1
            self._set_running(seq)
            budget.tokens -= num_new
            self._send_in_full(seq, num_new, plan)

    def _forkable(self) -> list[Sequence]:
        """Running seqs with samples waiting whose whole prompt was computed by plans already
        made (and so sent, and run before the plan being built, whose copies read it)."""
        seqs = (self._seqs[seq_id] for seq_id in self._forks)
        return [seq for seq in seqs if seq.status is SequenceStatus.RUNNING
                and seq.num_computed_tokens >= seq.num_prompt_tokens]

    def _schedule_forks(self, parents: list[Sequence], plan: StepPlan, budget: _Budget) -> None:
        """Each waiting sample takes its parent's prompt pages (the partial last one copied in
        this plan's `copy`) and computes the last prompt token: sent as a new seq with
        num_computed_tokens = prompt - 1. Stops when the pool, the budget or max_num_seqs is
        short; the rest wait for a later step (or for their parent to finish)."""
        bm = self.block_manager
        for parent in parents:
            samples = self._forks.get(parent.seq_id)
            if not samples or parent.status is not SequenceStatus.RUNNING:
                continue
            while samples:
                sample = samples[0]
                if budget.tokens <= 0 or not self._has_seq_room() or not bm.fork_prompt(
                        parent.seq_id, sample.seq_id, sample.num_tokens, plan.copy):
                    return
                samples.pop(0)
                del self._fork_parent[sample.seq_id]
                sample.num_computed_tokens = sample.num_tokens - 1
                self._num_started += 1
                self._set_running(sample)
                budget.tokens -= 1
                self._send_in_full(sample, 1, plan)
            del self._forks[parent.seq_id]

    def _release_samples(self, seq: Sequence) -> None:
        """seq finished before its samples forked: they prefill as requests of their own."""
        for sample in reversed(self._forks.pop(seq.seq_id, ())):
            del self._fork_parent[sample.seq_id]
            self.waiting.appendleft(sample)

    def _num_new_tokens(self, seq: Sequence, budget: _Budget) -> int:
        """Tokens to compute for a seq coming (back) onto the GPU; 0 when it must wait. One with
        a token still to be sampled waits for it: it is sent in full, every token known."""
        if seq.num_pending_tokens:
            return 0
        num_new = len(seq.token_ids) - seq.num_computed_tokens
        return num_new if num_new <= budget.tokens else self._chunk(num_new, budget.tokens)

    def _chunk(self, num_new: int, tokens_left: int) -> int:
        """What of num_new tokens, more than the tokens_left in the budget, this step computes:
        all those left with chunked prefill, else none (the seq waits for a step with room for
        all) unless no step could ever hold them (more than max_num_batched_tokens)."""
        config = self.config
        if config.enable_chunked_prefill or num_new > config.max_num_batched_tokens:
            return tokens_left
        return 0

    def _has_seq_room(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def _send_in_full(self, seq: Sequence, num_new: int, plan: StepPlan) -> None:
        """A seq the executor does not know (new, swapped in, recomputed, forked) goes in full,
        every token known: no sample may be outstanding. The prefix cache looks at it again."""
        assert seq.num_pending_tokens == 0, f"seq {seq.seq_id} resent with a pending token"
        plan.new_seqs.append(NewSeqPlan(
            seq_id=seq.seq_id, token_ids=list(seq.token_ids),
            block_table=self.block_manager.get_block_table(seq.seq_id),
            num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=num_new,
            sampling=seq.sampling, seed=seq.seed, num_prompt_tokens=seq.num_prompt_tokens))
        self._executor_seq_ids.add(seq.seq_id)
        self._advance(seq, num_new, plan)
        if self.block_manager.enable_prefix_caching:
            self._seqs_to_cache.add(seq.seq_id)

    @staticmethod
    def _advance(seq: Sequence, num_new: int, plan: StepPlan) -> None:
        """The scheduling rule: the scheduled tokens count as computed now (the next step may
        be planned before this one's result is back), and a seq they catch up with its tokens
        samples one more."""
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == len(seq.token_ids) + seq.num_pending_tokens:
            seq.num_pending_tokens += 1
            plan.sampling_seq_ids.append(seq.seq_id)

    # ---- preemption --------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take seq off the GPU: swap while the CPU pool has room (mode "swap"), else recompute."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self._offer_to_cache(seq)
        if seq.seq_id in self._executor_seq_ids:
            self._executor_seq_ids.discard(seq.seq_id)
            plan.preempted_seq_ids.append(seq.seq_id)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq.seq_id):
            self._preempt_by_swap(seq, plan)
        else:
            self._preempt_by_recompute(seq)

    def _preempt_by_swap(self, seq: Sequence, plan: StepPlan) -> None:
        """Its pages go to the CPU: copied, unless the CPU holds them already (a page it shares
        with a seq swapped out before, or a cached copy)."""
        num_pages = len(self.block_manager.get_block_table(seq.seq_id))
        pairs = self.block_manager.swap_out(seq.seq_id)
        plan.swap_out.extend(pairs)
        seq.status = SequenceStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=_age)
        self.num_preemptions_swap += 1
        self.num_blocks_swapped_out += len(pairs)
        self.num_blocks_swap_shared_out += num_pages - len(pairs)

    def _preempt_by_recompute(self, seq: Sequence) -> None:
        """Drop its KV; it recomputes prompt + generated tokens when admitted again, first."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions_recompute += 1

    # ---- results -----------------------------------------------------------------------------

    def update_from_output(self, plan: StepPlan, sampled: dict[int, int]) -> list[SeqUpdate]:
        """Apply a step's result (steps come back in order): append the sampled tokens, apply the
        token-level stop rules, free finished seqs' pages now. Seqs finished or aborted while the
        step was in flight are skipped; a plan from before reset_executor() is ignored. Raises
        ExecutorDisagreement, before changing anything, unless `sampled` covers exactly the
        plan's sampling seqs."""
        if plan.is_empty or plan.step_id <= self._last_updated_step_id:
            return []
        self._last_updated_step_id = plan.step_id
        planned = plan.sampling_seq_ids  # no duplicates: a seq is scheduled once per step
        if sampled.keys() != set(planned):  # fail before mutating anything (a set compare in C)
            missing = [i for i in planned if i not in sampled]
            extra = [i for i in sampled if i not in set(planned)]
            raise ExecutorDisagreement(
                f"step {plan.step_id}: the executor sampled another set of sequences than "
                f"planned (missing {missing[:8]}, unexpected {extra[:8]})")
        return self._append_tokens(planned, sampled)

    def _append_tokens(self, seq_ids: list[int], sampled: dict[int, int]) -> list[SeqUpdate]:
        """One update per seq still unfinished. Only a token that may stop its seq (a stop id,
        EOS or a length limit reached) goes through _check_stop: the pre-check is a few
        compares, and nearly every token stops nothing."""
        seqs, cap, updates = self._seqs, self._pool_len_cap(), []
        # A token that completes a page marks its seq for the prefix cache (0: caching is off).
        page = self.block_manager.block_size if self.block_manager.enable_prefix_caching else 0
        to_cache = self._seqs_to_cache
        for seq_id in seq_ids:
            seq = seqs.get(seq_id)
            if seq is None:  # finished or aborted while the step was in flight
                continue
            token_id = sampled[seq_id]
            seq.num_pending_tokens -= 1
            token_ids = seq.token_ids
            token_ids.append(token_id)  # not through a Sequence method: this loop is per token
            reason = None
            num_tokens = len(token_ids)
            if page and not num_tokens % page:
                to_cache.add(seq_id)
            if (token_id in seq.stop_token_set or num_tokens >= seq.length_limit
                    or num_tokens >= cap):
                reason = self._check_stop(seq, token_id)
                if reason is not None:
                    self._queue_of(seq).remove(seq)  # a preempted seq can still get its token
                    self._finish(seq, reason)
            updates.append(SeqUpdate(seq, token_id, reason))
        return updates

    def _check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Token-level stop rules; EOS and stop ids only count once min_tokens are out."""
        stopping = seq.stopping
        if seq.num_output_tokens >= stopping.min_tokens:
            if token_id == seq.eos_token_id and not stopping.ignore_eos:
                return FinishReason.EOS
            if token_id in stopping.stop_token_ids:
                return FinishReason.STOP_TOKEN
        if seq.num_tokens >= seq.length_limit or seq.num_tokens >= self._pool_len_cap():
            return FinishReason.LENGTH
        return None

    def _pool_len_cap(self) -> int:
        """No seq grows past this, whatever its length_limit: the KV of all but its last token
        fits the whole GPU pool (so a lone seq can always run: no deadlock on a pool smaller
        than max_model_len)."""
        bm = self.block_manager
        return bm.num_gpu_blocks * bm.block_size + 1

    # ---- bookkeeping -------------------------------------------------------------------------

    def _queue_of(self, seq: Sequence):
        queues = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                  SequenceStatus.SWAPPED: self.swapped}
        return queues[seq.status]

    def _set_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_age)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished (already off its queue), free its pages, tell the executor next step."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.seq_id in self._forks:
            self._release_samples(seq)
        self._offer_to_cache(seq)
        self.block_manager.free(seq.seq_id)
        del self._seqs[seq.seq_id]
        if seq.seq_id in self._executor_seq_ids:
            self._executor_seq_ids.discard(seq.seq_id)
            self._pending_finished_ids.append(seq.seq_id)

    def reset_executor(self) -> None:
        """The executor lost its state: free every block; every started unfinished seq goes back
        to waiting (oldest first, ahead of never-started ones) to recompute from token 0."""
        self.block_manager.reset()
        started = [*self.running, *self.swapped,
                   *(s for s in self.waiting if s.num_preemptions or s.num_output_tokens)]
        fresh = [s for s in self.waiting if not (s.num_preemptions or s.num_output_tokens)]
        for seq in [*started, *fresh]:
            seq.num_computed_tokens = 0
            seq.num_pending_tokens = 0  # the steps that would sample them are gone
        for seq in started:
            seq.status = SequenceStatus.WAITING
        self.waiting = deque(sorted(started, key=_age) + fresh)
        self.running, self.swapped = [], []
        self._executor_seq_ids.clear()
        self._pending_finished_ids = []
        self._seqs_to_cache = set()  # the new executor's cache is empty: so is the prefix cache
        self._last_updated_step_id = self._step_id
        self._drain.pause()  # no seq starts until an executor is back: not a slow queue

    # ---- owner API: what the engine asks instead of reaching into the block manager ----------

    @classmethod
    def for_executor(cls, config: SchedulerConfig, block_size: int, num_gpu_blocks: int,
                     num_cpu_blocks: int, cache_salt: str = "") -> "Scheduler":
        """A scheduler on block pools of the sizes an executor's Describe answered."""
        return cls(config, BlockManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                        enable_prefix_caching=config.enable_prefix_caching,
                                        cache_salt=cache_salt))

    def reset_for_executor(self, block_size: int, num_gpu_blocks: int,
                           num_cpu_blocks: int, cache_salt: str = "",
                           config: SchedulerConfig | None = None) -> None:
        """Another executor (or a restarted one) is attached: as reset_executor(), on new block
        pools of the sizes its Describe answered (an empty prefix cache, salted with its model
        fingerprint), and with `config` (its step limits) from the next schedule() if given."""
        self.reset_executor()
        if config is not None:
            self.config = config
        self.block_manager = BlockManager(
            block_size, num_gpu_blocks, num_cpu_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching, cache_salt=cache_salt)

    def stats(self) -> SchedulerStats:
        """Queues, pool usage and running counts, for status, metrics and the stats line."""
        bm = self.block_manager
        return SchedulerStats(
            running=len(self.running), swapped=len(self.swapped),
            waiting=self.num_waiting,
            gpu_blocks_used=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
            gpu_blocks_total=bm.num_gpu_blocks,
            cpu_blocks_used=bm.num_cpu_blocks - bm.num_free_cpu_blocks,
            cpu_blocks_total=bm.num_cpu_blocks,
            num_preemptions_swap=self.num_preemptions_swap,
            num_preemptions_recompute=self.num_preemptions_recompute,
            num_blocks_swapped_out=self.num_blocks_swapped_out,
            num_blocks_swapped_in=self.num_blocks_swapped_in,
            num_blocks_swap_shared_out=self.num_blocks_swap_shared_out,
            num_blocks_swap_shared_in=self.num_blocks_swap_shared_in,
            gpu_blocks_cached=bm.num_cached_gpu_blocks,
            cpu_blocks_cached=bm.num_cached_cpu_blocks,
            num_prefix_cache_queries=self.num_prefix_cache_queries,
            num_prefix_cache_hits=self.num_prefix_cache_hits,
            num_blocks_copied=self.num_blocks_copied)
