"""Factories for executor tests: HF reference models, runners on small caches, a tiny plan
driver that plays the scheduler's part (block allocation from a shuffled free list), and the real
scheduler driving a runner with two steps in flight."""
from __future__ import annotations

import functools
import random
from collections import deque
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from executor_svc import wire as executor_wire
from executor_svc.backends import get_backend
from executor_svc.cache_engine import CacheEngine, kv_cache_dtype as cache_dtype
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import DTYPES, build_hf_model, model_from_hf
from executor_svc.model_runner import ModelRunner
from executor_svc.step import (CachedRow, CachedSeqs, ExecutorInfo, NewSeq, SamplingOptions,
                               StepPlan, StepResult)
from scheduler_svc import wire as scheduler_wire
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence


@functools.lru_cache(maxsize=None)
def hf_model(preset: str):
    return build_hf_model(preset, seed=0)


class EagerReplay:
    """Stands in for a captured graph on CPU: the same static buffers, run eagerly."""

    def __init__(self, graphs, key: tuple[str, int]) -> None:
        self.graphs, self.key = graphs, key

    def replay(self) -> None:
        self.graphs.step(self.key)


def eager_graphs(runner: ModelRunner, batch_sizes=(1, 2, 4, 8), token_sizes=(), graphs_class=None,
                 **options):
    """CudaGraphs (or `graphs_class`) over the runner's model and cache whose replays (and
    piecewise ones, with options' piece_sizes) run eagerly, a block table never wider than the
    cache has blocks; options go to the class. No small-step ladder unless token_sizes are
    given."""
    from executor_svc.cuda_graphs import CudaGraphs

    graphs = (graphs_class or CudaGraphs)(runner.model, runner.cache_engine.kv_caches,
                                          runner.info.num_gpu_blocks, batch_sizes, token_sizes,
                                          **options)
    graphs.prepare(runner.input_batch.token_counts)
    graphs.graphs = {key: EagerReplay(graphs, key) for key in graphs.keys()}
    if graphs.piecewise is not None:
        eager_pieces(graphs.piecewise)
    return graphs


def eager_pieces(piecewise):
    """PiecewiseGraphs whose replays run eagerly."""
    piecewise.graphs = {key: EagerReplay(piecewise, key) for key in piecewise.keys()}
    return piecewise


def with_eager_graphs(runner: ModelRunner, batch_sizes=(1, 2, 4, 8), **options) -> ModelRunner:
    """The runner with eager_graphs(runner, batch_sizes, **options) as its graphs."""
    runner.graphs = eager_graphs(runner, batch_sizes, **options)
    return runner


def make_runner(hf, block_size: int = 4, num_gpu_blocks: int = 64, num_cpu_blocks: int = 32,
                max_model_len: int = 512) -> ModelRunner:
    backend = get_backend("cpu")
    config = ModelConfig.from_hf_config(hf.config)
    model = model_from_hf(hf, config, backend)
    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                        num_gpu_blocks, num_cpu_blocks, torch.float32, backend)
    info = ExecutorInfo("test", "fp", "float32", block_size, num_gpu_blocks, num_cpu_blocks,
                        max_model_len, config.vocab_size, "", "cpu")
    return ModelRunner(model, backend, cache, info)


def loaded_runner(model, config, backend, dtype_name: str, block_size: int, num_blocks: int,
                  max_model_len: int, kv_cache_dtype: str = "", graphs: bool = False
                  ) -> ModelRunner:
    """A runner of a loaded model on a cache of num_blocks pages of its dtype, or FP8 where
    kv_cache_dtype is "fp8_e4m3"; `graphs`: the decode ladder captured, every step sampled
    eagerly (so a RecordingSampler sees the logits)."""
    from executor_svc.cuda_graphs import CudaGraphs

    cache = CacheEngine(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                        num_blocks, 1, cache_dtype(kv_cache_dtype, DTYPES[dtype_name]), backend)
    info = ExecutorInfo("test", "fp", dtype_name, block_size, num_blocks, 1, max_model_len,
                        config.vocab_size, "", backend.name, kv_cache_dtype=kv_cache_dtype)
    cuda_graphs = None
    if graphs:
        cuda_graphs = CudaGraphs(model, cache.kv_caches, max_model_len // block_size,
                                 token_sizes=(), sample_in_graphs=False)
    runner = ModelRunner(model, backend, cache, info, cuda_graphs)
    if cuda_graphs is not None:
        cuda_graphs.capture(runner.input_batch.token_counts)
    return runner


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    gen = GenerationConfig(max_new_tokens=num_new, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = hf.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt):].tolist()


def execute(runner: ModelRunner, step: StepPlan) -> StepResult:
    """Launch and finish one step, with no other step unfinished (ModelRunner has no such call:
    the servicer always launches and finishes apart)."""
    return runner.finish(runner.launch(step))


def random_prompt(rng: random.Random, length: int, vocab: int = 49152) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


class PlanDriver:
    """Plays the scheduler: tracks tokens, block tables and counters; builds StepPlans."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.info.block_size
        self.free = list(range(runner.info.num_gpu_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order block tables
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.step_id = 0

    def blocks_needed(self, seq_id: int, num_tokens: int) -> list[int]:
        have = len(self.tables.get(seq_id, []))
        need = -(-num_tokens // self.block_size) - have
        new, self.free = self.free[:max(need, 0)], self.free[max(need, 0):]
        self.tables.setdefault(seq_id, []).extend(new)
        return new

    def new_seq(self, seq_id: int, tokens: list[int], num_scheduled: int | None = None,
                sampling: SamplingOptions = SamplingOptions(), num_computed: int = 0) -> NewSeq:
        self.tokens[seq_id] = list(tokens)
        n = len(tokens) - num_computed if num_scheduled is None else num_scheduled
        self.blocks_needed(seq_id, num_computed + n)
        self.computed[seq_id] = num_computed + n
        return NewSeq(seq_id, list(tokens), list(self.tables[seq_id]), num_computed, n, sampling)

    def cached_seq(self, seq_id: int, num_scheduled: int | None = None) -> CachedRow:
        computed = self.computed[seq_id]
        n = len(self.tokens[seq_id]) - computed if num_scheduled is None else num_scheduled
        new_blocks = self.blocks_needed(seq_id, computed + n)
        self.computed[seq_id] = computed + n
        return seq_id, n, computed, new_blocks

    def plan(self, cached_seqs=(), **fields) -> StepPlan:
        """The next step's plan; `cached_seqs` as rows that cached_seq made."""
        self.step_id += 1
        return StepPlan(self.step_id, cached_seqs=CachedSeqs.of(cached_seqs), **fields)

    def run(self, **fields) -> dict[int, int]:
        """Execute one step; append and return the sampled tokens {seq_id: token_id}."""
        out = execute(self.runner, self.plan(**fields))
        sampled = {s.seq_id: s.token_id for s in out.sampled}
        for seq_id, token_id in sampled.items():
            self.tokens[seq_id].append(token_id)
        return sampled


class RunnerLink:
    """A ModelRunner as ScheduledRun's executor. With `overlap`, a plan is launched when sent and
    finished when its result is read, so step N+1 is launched before step N is finished (what the
    servicer does when the plan is already there); without, each step is finished when sent."""

    def __init__(self, runner: ModelRunner, overlap: bool) -> None:
        self.runner, self.overlap = runner, overlap
        self.launched_with_pending = 0  # launches while an earlier step was unfinished
        self.tokens_sent = self.tokens_omitted = 0  # new seqs' token ids on the wire, and not
        self._handles: deque = deque()  # PendingStep (overlap) or StepResult

    def send(self, message) -> None:
        step = executor_wire.plan_from_proto(message)
        self.tokens_sent += sum(len(s.token_ids) for s in message.new_seqs)
        self.tokens_omitted += sum(s.first_position for s in message.new_seqs)
        if self.overlap:
            self.launched_with_pending += self.runner.num_pending_steps > 0
            self._handles.append(self.runner.launch(step))
        else:
            self._handles.append(execute(self.runner, step))

    def receive(self):
        handle = self._handles.popleft()
        return self.runner.finish(handle) if self.overlap else handle


class ScheduledRun:
    """The real Scheduler planning with two steps in flight, as its engine does (step N+2 is
    planned once step N's result is applied), against `link` (send(StepPlan message),
    receive() -> a result with step_id and sampled seq_id/token_id, and logprob in process: the
    wire carries none, so a gRPC link's results record None).

    Sent plans are numbered 1, 2, ... here: the scheduler also spends a step id on a plan with
    nothing in it, which is never sent, and the executor refuses the gap that leaves."""

    def __init__(self, sched, link) -> None:
        self.sched, self.link = sched, link
        self.results: list[tuple[int, list[tuple[int, int, float]]]] = []  # per step, in order
        self.outputs: dict[int, list[int]] = {}  # seq_id -> the tokens the scheduler kept
        self._in_flight: deque = deque()  # (plan, step id sent)
        self._num_sent = 0

    def run(self, between=None, max_steps: int = 10_000) -> "ScheduledRun":
        """Until every seq finished; `between(step_id)` runs after each result is applied."""
        for _ in range(max_steps):
            self._fill()
            if not self._in_flight:
                return self
            (plan, step_id), out = self._in_flight.popleft(), self.link.receive()
            assert out.step_id == step_id
            sampled = [(t.seq_id, t.token_id, getattr(t, "logprob", None)) for t in out.sampled]
            self.results.append((out.step_id, sampled))
            for update in self.sched.update_from_output(plan, {s: t for s, t, _ in sampled}):
                self.outputs.setdefault(update.seq.seq_id, []).append(update.token_id)
            if between is not None:
                between(step_id)
        raise AssertionError(f"not finished after {max_steps} steps")

    def _fill(self) -> None:
        while len(self._in_flight) < 2 and self.sched.has_unfinished():
            plan = self.sched.schedule()
            if plan.is_empty:
                return
            self._num_sent += 1
            message = scheduler_wire.plan_to_proto(plan)
            message.step_id = self._num_sent
            self.link.send(message)
            self._in_flight.append((plan, self._num_sent))


def assert_same_results(run: ScheduledRun, reference: ScheduledRun) -> None:
    """Two ScheduledRuns of one workload: the same outputs; step by step the same sampled
    (seq, token) pairs and the same seqs with logprobs (add_workload's seeded ones), those
    logprobs within 1e-5; and some logprob compared."""
    assert run.outputs == reference.outputs
    num_logprobs = 0
    for (step_a, a), (step_b, b) in zip(run.results, reference.results, strict=True):
        assert step_a == step_b and [x[:2] for x in a] == [x[:2] for x in b]
        assert [x[2] is None for x in a] == [x[2] is None for x in b]
        got, want = ([x[2] for x in r if x[2] is not None] for r in (a, b))
        num_logprobs += len(got)
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert num_logprobs > 0


def add_workload(sched, seed: int, num_seqs: int = 10, vocab: int = 49152) -> dict[int, list[int]]:
    """Prompts of 1-20 tokens, 1-14 output tokens; odd seqs greedy, even ones seeded samples
    that ask for their logprobs (so that runs can be compared on them too). Returns the
    prompts."""
    rng = random.Random(seed)
    prompts = {}
    for seq_id in range(1, num_seqs + 1):
        sampling = (SamplingParams() if seq_id % 2 else
                    SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + seq_id,
                                   logprobs=1))
        prompts[seq_id] = random_prompt(rng, rng.randint(1, 20), vocab)
        sched.add_seq(Sequence(seq_id, prompts[seq_id], sampling,
                               StoppingParams(max_tokens=rng.randint(1, 14)), eos_token_id=None,
                               max_model_len=512, arrival_time=float(seq_id)))
    return prompts


def make_scheduler(info: ExecutorInfo, **config) -> Scheduler:
    """A scheduler sized from the executor's info (as Describe's answer sizes it)."""
    block_manager = BlockManager(info.block_size, info.num_gpu_blocks, info.num_cpu_blocks)
    return Scheduler(SchedulerConfig(**config), block_manager, rng=random.Random(0))


def spy_on_graph_sampling(runner: ModelRunner) -> list[bool]:
    """Wraps runner.graphs.run; the list returned gets, per decode replay, whether the graph
    sampled the step (else the runner sampled its logits eagerly)."""
    sampled, run = [], runner.graphs.run

    def spy(inputs, sampling=None, *args):
        out = run(inputs, sampling, *args)
        if inputs.is_decode:
            sampled.append(out[1] is not None)
        return out
    runner.graphs.run = spy
    return sampled


def held_tokens(runner: ModelRunner, seq_id: int):
    """A held seq's tokens known on the host: a view of its InputBatch row (writes change it)."""
    batch = runner.input_batch
    return batch.tokens(batch.row(seq_id))


def held_num_tokens(runner: ModelRunner, seq_id: int) -> int:
    """A held seq's tokens, those sampled by unfinished steps included."""
    batch = runner.input_batch
    return int(batch.num_tokens[batch.row(seq_id)])


def two_seqs_decoding(driver: PlanDriver, seed: int) -> dict[int, list[int]]:
    """Seqs 1 and 2 (random prompts of 9 and 6 tokens) prefilled, then three decode steps: pages
    of both in the cache, one half full. Returns their prompts."""
    rng = random.Random(seed)
    prompts = {1: random_prompt(rng, 9), 2: random_prompt(rng, 6)}
    driver.run(new_seqs=[driver.new_seq(s, p) for s, p in prompts.items()])
    for _ in range(3):
        driver.run(cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    return prompts


def fork_on_write(driver: PlanDriver, parent: int, child: int) -> tuple[int, int]:
    """Copy-on-write as the scheduler forks: the child shares the parent's pages but its last,
    copied (copy_blocks) in the step the child joins to compute its last token beside the
    parent's decode. Returns (the parent's last page, the child's copy)."""
    table = driver.tables[parent]
    child_last = driver.free.pop()
    driver.tables[child] = table[:-1] + [child_last]
    tokens = list(driver.tokens[parent])
    driver.run(copy=[(table[-1], child_last)],
               new_seqs=[driver.new_seq(child, tokens, 1, num_computed=len(tokens) - 1)],
               cached_seqs=[driver.cached_seq(parent)])
    return table[-1], child_last


# -- bf16 against transformers (test_cuda_backend, test_families_gpu) -----------------------------

def decode_all(driver: PlanDriver, prompts: dict[int, list[int]], num_new: int) -> None:
    """Every prompt prefilled in one step, then decode steps until each seq has num_new tokens."""
    driver.run(new_seqs=[driver.new_seq(s, p) for s, p in prompts.items()])
    while min(len(driver.tokens[s]) - len(p) for s, p in prompts.items()) < num_new:
        driver.run(cached_seqs=[driver.cached_seq(s) for s, p in prompts.items()
                                if len(driver.tokens[s]) - len(p) < num_new])


@torch.inference_mode()
def hf_generate(hf, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy tokens on the model's device, exactly num_new of them."""
    gen = GenerationConfig(max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = hf.generate(torch.tensor([prompt], device=hf.device),
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                device=hf.device),
                      generation_config=gen)
    return out[0, len(prompt):].tolist()


class RecordingSampler:
    """Keeps each step's logits (rows in sampling order) before delegating."""

    def __init__(self, inner) -> None:
        self.inner, self.logits = inner, []

    def sample(self, logits, params):
        self.logits.append(logits.float().clone())
        return self.inner.sample(logits, params)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)  # per position


@dataclass
class Bf16Reference:
    """transformers' greedy tokens for each prompt, and its teacher-forced logits on them
    ([num_new, vocab] per seq) in the model's bf16 and in float32."""

    prompts: dict[int, list[int]]
    tokens: dict[int, list[int]]
    logits: dict[int, torch.Tensor]
    fp32_logits: dict[int, torch.Tensor]

    @property
    def num_new(self) -> int:
        return len(next(iter(self.tokens.values())))


def bf16_reference(hf, prompts: dict[int, list[int]], num_new: int) -> Bf16Reference:
    """From a bf16 transformers model; a float32 copy of it lives only while it computes."""
    import copy

    tokens = {s: hf_generate(hf, p, num_new) for s, p in prompts.items()}
    forced = {s: torch.tensor([p + tokens[s][:-1]], device=hf.device) for s, p in prompts.items()}
    with torch.inference_mode():
        logits = {s: hf(ids).logits[0, len(prompts[s]) - 1:].float() for s, ids in forced.items()}
        hf32 = copy.deepcopy(hf).float()
        fp32 = {s: hf32(ids).logits[0, len(prompts[s]) - 1:].float() for s, ids in forced.items()}
        del hf32
    return Bf16Reference(dict(prompts), tokens, logits, fp32)


def compare_bf16_with_transformers(runner: ModelRunner, ref: Bf16Reference, label: str
                                   ) -> tuple[dict[int, bool], dict[int, bool]]:
    """The bf16 tolerance, measured rather than guessed: transformers' own bf16 logits against
    the same model in float32. Ours may be at most twice that far from transformers' bf16 logits
    (plus 0.5%), position by position, on the teacher-forced sequence (every decode step a graph
    replay); a position's own bf16 error can fall well below its sequence's by chance, so the
    bound takes the larger of the two. Then free-running greedy (new seqs) must be identical
    until transformers' top-2 margin is within twice the largest logit difference seen at that
    position. Returns ({seq: within}, {seq: identical}) for the caller to assert once it has freed the GPU."""
    ours = _teacher_forced_logits(runner, ref)  # [seqs, num_new, vocab]
    tolerance, within = {}, {}
    for row, (s, hf_logits) in enumerate(ref.logits.items()):
        ours_vs_hf = rel_error(ours[row], hf_logits)
        hf_vs_fp32 = rel_error(hf_logits, ref.fp32_logits[s])
        print(f"{label} seq {s}: ||ours-hf||/||hf|| max {ours_vs_hf.max():.4f} mean "
              f"{ours_vs_hf.mean():.4f}; transformers bf16 vs fp32 mean {hf_vs_fp32.mean():.4f}; "
              f"ours vs fp32 mean {rel_error(ours[row], ref.fp32_logits[s]).mean():.4f}")
        within[s] = bool((ours_vs_hf <= 2 * hf_vs_fp32.clamp(min=hf_vs_fp32.mean()) + 0.005).all())
        tolerance[s] = (ours[row] - hf_logits).abs().max(dim=-1).values  # [num_new]
    runner.reset()
    driver = PlanDriver(runner, seed=1)
    decode_all(driver, {s + 10: p for s, p in ref.prompts.items()}, ref.num_new)
    identical = {}
    for s, prompt in ref.prompts.items():
        top2 = ref.logits[s].topk(2, dim=-1).values
        near_tie = ((top2[:, 0] - top2[:, 1]) <= 2 * tolerance[s]).nonzero()
        stop = int(near_tie[0]) if len(near_tie) else ref.num_new
        got = driver.tokens[s + 10][len(prompt):len(prompt) + ref.num_new]
        first_diff = next((i for i, (a, b) in enumerate(zip(got, ref.tokens[s])) if a != b), None)
        print(f"{label} seq {s}: greedy identical through {stop}/{ref.num_new} required "
              f"(first differing position: {first_diff})")
        identical[s] = got[:stop] == ref.tokens[s][:stop]
    return within, identical


def teacher_forced(runner: ModelRunner, ref: Bf16Reference, device) -> dict:
    """{seq: [NUM_NEW, vocab] float32 logits} on ref's tokens, on `device`."""
    logits = _teacher_forced_logits(runner, ref)
    runner.reset()
    return {s: logits[row].to(device) for row, s in enumerate(ref.prompts)}


def _teacher_forced_logits(runner: ModelRunner, ref: Bf16Reference) -> torch.Tensor:
    """Our logits with transformers' tokens fed back instead of ours: [seqs, num_new, vocab],
    seqs in ref.prompts' order."""
    recorder = runner.sampler = RecordingSampler(runner.sampler)
    sampled_ids, run = [], runner._run  # each step's sampling seqs in row order (longest first)

    def recording_run(step_id, batch, marks):
        pending = run(step_id, batch, marks)
        sampled_ids.append([int(s) for s in pending.seq_ids])
        return pending

    runner._run = recording_run
    try:
        driver = PlanDriver(runner)
        driver.run(new_seqs=[driver.new_seq(s, p) for s, p in ref.prompts.items()])
        for k in range(1, ref.num_new):
            for s in ref.prompts:
                held_tokens(runner, s)[-1] = ref.tokens[s][k - 1]
            driver.run(cached_seqs=[driver.cached_seq(s) for s in ref.prompts])
    finally:
        runner._run, runner.sampler = run, recorder.inner
    assert len(sampled_ids) == len(recorder.logits) == ref.num_new
    return torch.stack([logits[[ids.index(s) for s in ref.prompts]]  # rows by seq, as prompts
                        for logits, ids in zip(recorder.logits, sampled_ids)], dim=1)
