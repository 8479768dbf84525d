"""The decode graphs' sampling (GraphSampler) against the eager Sampler, its reference (issue 13):
the static-buffer path run eagerly on CPU (and, marked gpu, captured and replayed) gives the same
token ids, raw logprobs, top logprobs and penalty counts on fresh random logits, for every
variant, with mixed batches, padding rows, rows that do not sample and steps that reuse the
buffers; steps that fit no graph fall back to the eager Sampler; the runner gives the same
results through eager-replayed graphs as without graphs; the memory profile reserves the
counts and the graphs' buffers."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from executor_svc.graph_sampler import (
    CONTROLLED, GREEDY, SAMPLED, GraphSampler, StepSampling,
)
from executor_svc.memory_profile import graph_reserve_bytes, graph_sampling_peak, profile_sampling
from executor_svc.sampler import Sampler, SamplingTensors
from executor_svc.step import SamplingOptions
from executor_svc.token_counts import TokenCounts
from tests.executor_svc.helpers import (PlanDriver, execute, hf_model, make_runner,
                                        random_prompt, spy_on_graph_sampling,
                                        with_eager_graphs)
from tests.gpu import gpu_ready

VOCAB = 1000
MAX_BATCH = 16


def _mix(i: int) -> dict[str, SamplingOptions]:
    return {
        "greedy": SamplingOptions(),
        "plain": SamplingOptions(temperature=0.8, seed=i),  # no filter: the SAMPLED variant
        "sampled": SamplingOptions(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=i),
        "penalties": SamplingOptions(repetition_penalty=1.3, presence_penalty=0.4,
                                     frequency_penalty=0.3),
        "sampled_penalties": SamplingOptions(temperature=1.2, seed=i, repetition_penalty=0.8,
                                             frequency_penalty=-0.5),
        "bias": SamplingOptions(logit_bias=((3, 5.0), (10 + i, -2.5), (11 + i, 40.0))),
        "logprobs": SamplingOptions(temperature=0.7, seed=i, logprobs=5),
        "logprobs0": SamplingOptions(logprobs=0),
        "everything": SamplingOptions(temperature=1.1, top_p=0.8, top_k=100, seed=i,
                                      repetition_penalty=1.5, presence_penalty=-0.5,
                                      logit_bias=((7, 1.5),), logprobs=20),
    }


def _options(kinds: list[str]) -> list[SamplingOptions]:
    return [_mix(i)[k] for i, k in enumerate(kinds)]


class StaticPath:
    """A GraphSampler whose parameter region is copied to its device twin as CudaGraphs copies
    it (from the variant's start only), run eagerly (or, with `capture`, through CUDA graphs)."""

    def __init__(self, device: torch.device, counts: TokenCounts, **limits) -> None:
        self.gs = GraphSampler(MAX_BATCH, VOCAB, device, **limits)
        self.host = np.zeros(self.gs.num_slots, dtype=np.int64)
        self.params = torch.zeros(self.gs.num_slots, dtype=torch.int64, device=device)
        self.gs.bind(self.params, counts)
        self.gs.pack_neutral(self.host)
        self.params.copy_(torch.from_numpy(self.host))
        # What SAMPLED and GREEDY steps never read: poisoned until a CONTROLLED step copies it.
        self.params[:self.gs.starts[SAMPLED]] = -7
        self.logits = torch.zeros(MAX_BATCH, VOCAB, device=device)  # [n, vocab]: a graph's input
        self.graphs: dict | None = None

    def capture(self) -> None:
        """CUDA graphs of sample_into for every (variant, bs), after an eager warm-up."""
        pool, self.graphs = torch.cuda.graph_pool_handle(), {}
        sizes = (1, 2, 4, 8, 16)
        # The warm-up and capture run every variant on what the buffers hold: neutral parameters,
        # not the poison (its indices are out of range: a device-side assert on the GPU).
        poisoned = self.params[:self.gs.starts[SAMPLED]].clone()
        self.params.copy_(torch.from_numpy(self.host))
        for bs in sizes:
            for v in self.gs.variants(bs):
                self.gs.sample_into(self.logits[:bs], v)
        torch.cuda.synchronize()
        for bs in reversed(sizes):
            for v in self.gs.variants(bs):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.gs.sample_into(self.logits[:bs], v)
                self.graphs[(v, bs)] = graph
        torch.cuda.synchronize()
        self.params[:self.gs.starts[SAMPLED]] = poisoned

    def run(self, logits: torch.Tensor, step: StepSampling, bs: int):
        """logits [num_rows, vocab]; returns (variant, results) or (None, None) to fall back."""
        variant = self.gs.variant(step, bs)
        if variant is None:
            return None, None
        self.gs.pack(self.host, bs, step, variant)
        start = self.gs.starts[variant]
        self.params[start:].copy_(torch.from_numpy(self.host[start:]))
        num_rows = logits.shape[0]
        self.logits[:num_rows] = logits
        self.logits[num_rows:bs] = torch.randn(bs - num_rows, VOCAB) * 5  # padding rows
        if self.graphs is None:
            self.gs.sample_into(self.logits[:bs], variant)
        else:
            self.graphs[(variant, bs)].replay()
        index = None
        if len(step.rows) < num_rows:
            index = torch.from_numpy(step.rows).to(self.logits.device)
        return variant, self.gs.results(num_rows, index, step.num_top_logprobs)


def _eager(logits, options, positions, counts, count_rows, k):
    params = SamplingTensors.build(options, positions, VOCAB, logits.device, counts, count_rows)
    ids, logprobs = Sampler().sample(logits, params)
    if params.penalties is not None:
        counts.count(params.penalties.count_rows, ids[params.penalties.index])
    top = Sampler().top_logprobs(logits, k) if k else None
    return ids, logprobs, top


class Pair:
    """The static path and the eager reference over the same seqs, each with its own counts."""

    def __init__(self, device, **limits) -> None:
        self.device = device
        self.counts, self.ref_counts = (TokenCounts(VOCAB, device), TokenCounts(VOCAB, device))
        self.path = StaticPath(device, self.counts, **limits)
        self.rng = random.Random(0)

    def add(self, options: list[SamplingOptions]) -> tuple[list, list]:
        rows, ref_rows = [], []
        for o in options:
            if not o.uses_penalties:
                rows.append(None), ref_rows.append(None)
                continue
            prompt = [self.rng.randrange(VOCAB) for _ in range(6)]
            output = [self.rng.randrange(40) for _ in range(5)]  # repeats: counts > 1
            rows.append(self.counts.add(prompt, output))
            ref_rows.append(self.ref_counts.add(prompt, output))
        return rows, ref_rows

    def check(self, options, samples: list[int], num_rows: int, bs: int, seed: int,
              count_rows=None) -> str | None:
        """One step: rows `samples` of num_rows sample with `options`; compares the paths."""
        if count_rows is None:
            count_rows = self.add(options)
        logits = (torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))
                  * 4).to(self.device)
        logits[:, 5] = logits[:, 6]  # a tie: both paths must pick the same one
        positions = np.array([100 + seed + i for i in range(len(samples))], dtype=np.int64)
        step = StepSampling(np.array(samples, dtype=np.int64), options, positions,
                            count_rows[0])
        variant, got = self.path.run(logits, step, bs)
        k = step.num_top_logprobs
        want = _eager(logits[samples], options, positions.tolist(), self.ref_counts,
                      count_rows[1], k)
        if variant is None:
            return None
        assert torch.equal(got[0].cpu(), want[0].cpu()), (variant, got[0], want[0])
        torch.testing.assert_close(got[1].cpu(), want[1].cpu(), rtol=1e-6, atol=1e-6)
        if k:
            assert torch.equal(got[2][0].cpu(), want[2][0].cpu())
            torch.testing.assert_close(got[2][1].cpu(), want[2][1].cpu(), rtol=1e-6, atol=1e-6)
        else:
            assert got[2] is None
        n = self.ref_counts.num_rows
        if n:
            assert torch.equal(self.counts.output_counts[:n].cpu(),
                               self.ref_counts.output_counts.cpu())
        assert not self.counts.output_counts[self.counts.neutral_row].any()
        return variant


GREEDY_ROWS = ["greedy"] * 5
SAMPLED_ROWS = ["greedy", "plain", "plain", "greedy", "plain"]
CONTROLLED_ROWS = ["greedy", "sampled", "penalties", "bias", "logprobs", "logprobs0",
                   "sampled_penalties", "everything"]


@pytest.mark.parametrize("kinds,variant", [
    (GREEDY_ROWS, GREEDY), (["greedy", "logprobs0"], GREEDY), (SAMPLED_ROWS, SAMPLED),
    (CONTROLLED_ROWS, CONTROLLED), (["bias"], CONTROLLED), (["logprobs"], CONTROLLED),
    (["plain", "sampled", "greedy"], CONTROLLED),  # filters sort: the controlled variant
])
@pytest.mark.parametrize("layout", ["all_sample", "padded", "some_do_not_sample"])
def test_each_variant_gives_the_eager_samplers_results(kinds, variant, layout):
    pair = Pair(torch.device("cpu"))
    m = len(kinds)
    num_rows, samples = {"all_sample": (m, list(range(m))),
                         "padded": (m, list(range(m))),
                         "some_do_not_sample": (m + 2, [0] + list(range(2, m + 1)))}[layout]
    bs = next(b for b in (1, 2, 4, 8, 16) if b >= num_rows)
    if layout == "padded":
        bs = 16
    options = _options(kinds)
    got = pair.check(options, samples, num_rows, bs, seed=1)
    assert got == variant


def test_steps_in_turn_leave_nothing_behind():
    """Variants after one another over the same buffers and counts: a sampled step after a
    controlled one, a smaller controlled batch after a larger one, penalties counted across
    steps on the device."""
    pair = Pair(torch.device("cpu"))
    options = _options(CONTROLLED_ROWS)
    count_rows = pair.add(options)
    plan = [(SAMPLED_ROWS, None, 8), (CONTROLLED_ROWS, count_rows, 8), (SAMPLED_ROWS, None, 16),
            (GREEDY_ROWS, None, 8), (CONTROLLED_ROWS[:3], ([r for r in count_rows[0][:3]],
                                                           count_rows[1][:3]), 4),
            (CONTROLLED_ROWS, count_rows, 16)]
    seen = []
    for seed, (kinds, rows, bs) in enumerate(plan):
        opts = options[:len(kinds)] if rows is not None else _options(kinds)
        seen.append(pair.check(opts, list(range(len(kinds))), len(kinds), bs, seed, rows))
    assert seen == [SAMPLED, CONTROLLED, SAMPLED, GREEDY, CONTROLLED, CONTROLLED]
    assert pair.ref_counts.output_counts.sum() > 0


def test_steps_that_fit_no_graph_fall_back():
    pair = Pair(torch.device("cpu"), max_controlled_batch=4, max_logit_bias=4)
    gs = pair.path.gs

    def variant(kinds, bs=4, count_rows=None):
        options = _options(kinds)
        return gs.variant(StepSampling(np.arange(len(kinds)), options, np.zeros(len(kinds)),
                                       count_rows or [None] * len(kinds)), bs)

    assert variant(["bias"]) == CONTROLLED  # 3 entries
    assert variant(["bias", "bias"]) is None  # 6 entries > 4
    assert variant(["logprobs"]) == CONTROLLED and variant(["logprobs"], bs=8) is None
    assert variant(["plain"], bs=16) == SAMPLED and variant(["greedy"], bs=16) == GREEDY
    assert variant(["plain", "sampled"]) == CONTROLLED  # a filter: sorted where it fits
    assert variant(["plain", "sampled"], bs=8) is None
    over = SamplingOptions(logprobs=21)
    assert gs.variant(StepSampling(np.arange(1), [over], np.zeros(1), [None]), 1) is None
    assert variant(["penalties"], count_rows=[0]) == CONTROLLED
    for _ in range(MAX_BATCH + 1):  # TokenCounts grows past what the graphs read
        pair.counts.add([1], [])
    assert variant(["penalties"], count_rows=[0]) is None
    assert variant(["bias"]) == CONTROLLED  # no penalties: the counts are not read
    # a fallen-back step still matches (the eager Sampler samples it: Pair.check returns None)
    assert pair.check(_options(["bias", "bias", "greedy"]), [0, 1, 2], 3, 4, seed=3) is None


def test_token_counts_reserve_a_neutral_row():
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    first = counts.add([1, 2], [3])
    counts.reserve(10)
    assert counts.num_rows == 11 and counts.neutral_row == 10
    assert counts.output_counts[first, 3] == 1  # kept
    rows = [counts.add([], []) for _ in range(9)] + [counts.add([], [])]  # the last one grows
    assert counts.num_rows > 11 and counts.neutral_row not in rows
    assert len(set(rows + [first])) == 11
    counts.count(torch.tensor([rows[0], 10]), torch.tensor([9, 9]),
                 torch.tensor([1, 0], dtype=torch.int32))
    assert counts.output_counts[rows[0], 9] == 1 and not counts.output_counts[10].any()
    counts.clear()
    assert counts.neutral_row not in [counts.add([], []) for _ in range(counts.num_rows - 1)]


def test_token_counts_reserved_under_inference_mode_take_rows_outside_it():
    """The memory profile and the graph sampler reserve inside torch.inference_mode; the runner
    then adds and counts rows outside it (an inference tensor refuses that: the H200 caught it)."""
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    with torch.inference_mode():
        counts.reserve(4)
    row = counts.add([1, 2], [3, 3])
    counts.count(torch.tensor([row]), torch.tensor([5]))
    assert counts.prompt_mask[row, 1] and counts.output_counts[row, 3] == 2
    assert counts.output_counts[row, 5] == 1
    with torch.inference_mode():  # and inside it, as a graph's capture does
        counts.count(torch.tensor([row]), torch.tensor([5]))
        grown = [counts.add([], [7]) for _ in range(counts.num_rows)]  # grows under it too
    assert counts.output_counts[row, 5] == 2 and counts.output_counts[grown[-1], 7] == 1
    counts.add([4], [])  # a row added outside after growing inside


# -- the runner: eager-replayed graphs against no graphs --------------------------------------

def test_runner_through_graph_sampling_matches_the_eager_path():
    """Six seqs of every kind decode to different lengths (batches of 6, padded to 8, then
    fewer); the controlled variant is captured up to 4 rows, so the first steps fall back to
    the eager Sampler and the later ones sample in the graph."""
    kinds = ["greedy", "sampled", "penalties", "bias", "logprobs", "everything"]
    options = [_mix(i + 1)[k] for i, k in enumerate(kinds)]
    num_new = [9, 3, 10, 5, 12, 6]
    tokens = {}
    for name, graphs in (("eager", None), ("graphs", {"max_controlled_batch": 4})):
        tokens[name] = _driven(graphs, options, num_new)
    (eager, _), (graphed, variants) = tokens["eager"], tokens["graphs"]
    assert [x[:2] for x in graphed] == [x[:2] for x in eager]
    assert [x[3] for x in graphed] == [x[3] for x in eager]
    for a, b in zip(graphed, eager):
        assert (a[2] is None) == (b[2] is None)
        if a[2] is not None:
            assert abs(a[2] - b[2]) < 1e-5
            np.testing.assert_allclose(a[4], b[4], rtol=0, atol=1e-5)
    assert False in variants and True in variants  # fell back, then sampled in the graph


def _driven(graphs, options, num_new):
    """(every sampled token with its logprobs, in step order; whether each replay sampled)."""
    hf = hf_model("tiny")
    runner = make_runner(hf)
    variants = []
    if graphs is not None:
        with_eager_graphs(runner, **graphs)
        variants = spy_on_graph_sampling(runner)
    driver = PlanDriver(runner)
    rng = random.Random(21)
    prompts = {i: random_prompt(rng, 3 + i) for i in range(len(options))}
    sampled = []

    def step(**fields):
        out = execute(runner, driver.plan(**fields))
        for t in out.sampled:
            driver.tokens[t.seq_id].append(t.token_id)
            sampled.append((t.seq_id, t.token_id, t.logprob, t.top_token_ids, t.top_logprobs))

    step(new_seqs=[driver.new_seq(i, p, sampling=options[i]) for i, p in prompts.items()])
    while left := [i for i in prompts if len(driver.tokens[i]) - len(prompts[i]) < num_new[i]]:
        step(cached_seqs=[driver.cached_seq(i) for i in left])
    return sampled, variants


# -- memory profile ----------------------------------------------------------------------------

def test_memory_profile_reserves_the_counts_and_the_graph_samplers_buffers():
    vocab, rows = 128_256, 1024
    base = graph_reserve_bytes(vocab, rows, 0)
    counts = TokenCounts.bytes_for(rows, vocab)
    assert counts == 1025 * vocab * 5 and 0.6e9 < counts < 0.7e9
    assert base >= (1 << 30) + counts + rows * vocab * 4  # pool allowance, counts, logits
    assert graph_reserve_bytes(vocab, rows, 3 << 30) == base + (3 << 30)  # the sampling peak
    assert graph_reserve_bytes(vocab, 2 * rows, 0) - base > counts  # grows with the batch


def test_profiled_sampling_runs_every_control_on_cpu():
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    counts.reserve(8)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5))
    assert profile_sampling(logits, counts) == 0  # no allocator to read off CUDA
    assert counts.output_counts.sum() == 8  # every row penalised: its sampled id counted


def test_the_graphs_sampling_is_profiled_on_the_variants_they_capture():
    """The decode graphs' reserve samples what they capture: every control on the controlled
    variant's rows only (their sampled ids counted), a temperature alone on the whole batch."""
    rows, controlled = 300, 256
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    counts.reserve(rows)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(6))
    assert graph_sampling_peak(logits, counts, controlled) == 0  # no allocator off CUDA
    assert counts.output_counts.sum() == controlled
    assert not counts.output_counts[controlled:rows].any()


# -- GPU: captured graphs replayed against the eager Sampler ----------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_ready(), reason="needs CuPy and a GPU")
def test_captured_graph_sampling_matches_the_eager_sampler_on_gpu():
    """sample_into captured per (variant, size) and replayed on fresh random logits, its
    parameters packed and copied as CudaGraphs does, against the eager Sampler on the same
    GPU logits: same ids, top ids and counts, logprobs within float32 rounding. (That a whole
    decode step syncs nothing is test_cuda_backend's test_decode_step_has_no_host_sync.)"""
    pair = Pair(torch.device("cuda"))
    pair.path.capture()
    cases = [(GREEDY_ROWS, 8), (SAMPLED_ROWS, 8), (CONTROLLED_ROWS, 8), (SAMPLED_ROWS, 16),
             (CONTROLLED_ROWS, 16), (["everything"], 1), (GREEDY_ROWS, 16)]
    seen = []
    for seed, (kinds, bs) in enumerate(cases * 3):
        options = _options(kinds)
        count_rows = pair.add(options)
        seen.append(pair.check(options, list(range(len(kinds))), len(kinds), bs, seed,
                               count_rows))
        for counts, rows in zip((pair.counts, pair.ref_counts), count_rows):
            for row in rows:
                if row is not None:
                    counts.free(row)
    assert seen == [GREEDY, SAMPLED, CONTROLLED, SAMPLED, CONTROLLED, CONTROLLED, GREEDY] * 3
