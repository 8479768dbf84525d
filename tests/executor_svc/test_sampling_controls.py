"""Penalties, logit bias and logprobs through the ModelRunner (CPU backend, float32), against
transformers' generate with its logits processors on the same weights: greedy token identity,
across a chunked prefill and a re-admission that rebuilds the token counts (issue 13)."""
import dataclasses
import random

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from executor_svc.step import SamplingOptions, StepPlan, StepResult
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.sequence import Sequence
from tests.executor_svc.helpers import (PlanDriver, RunnerLink, ScheduledRun, hf_model,
                                        make_runner, make_scheduler, random_prompt)

NUM_NEW = 12


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties on the generated tokens (transformers has none)."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.num_prompt:],
                            torch.ones_like(input_ids[:, self.num_prompt:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@torch.inference_mode()
def _hf_generate(hf, prompt, options: SamplingOptions, num_new: int = NUM_NEW):
    """Greedy tokens and each step's raw logits, with the options' processors."""
    processors = LogitsProcessorList()
    if options.presence_penalty or options.frequency_penalty:
        processors.append(_OpenAIPenalties(len(prompt), options.presence_penalty,
                                           options.frequency_penalty))
    gen = GenerationConfig(
        max_new_tokens=num_new, min_new_tokens=0, do_sample=False, eos_token_id=None,
        pad_token_id=0, repetition_penalty=options.repetition_penalty,
        sequence_bias={(t,): b for t, b in options.logit_bias} or None,
        return_dict_in_generate=True, output_logits=True)
    out = hf.generate(torch.tensor([prompt]), generation_config=gen, logits_processor=processors)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)  # [NUM_NEW, vocab]


def _step(driver: PlanDriver, **fields) -> StepResult:
    """One step through the runner, its sampled tokens appended to the driver's."""
    result = driver.runner.finish(driver.runner.launch(driver.plan(**fields)))
    for t in result.sampled:
        driver.tokens[t.seq_id].append(t.token_id)
    return result


CASES = {
    "repetition": SamplingOptions(repetition_penalty=1.8),
    "repetition_below_1": SamplingOptions(repetition_penalty=0.7),
    # signs mixed: a token generated once gains 0.7, twice loses 0.1 (this random model never
    # repeats a token by itself, so positive penalties alone would change nothing)
    "presence_frequency": SamplingOptions(presence_penalty=-1.5, frequency_penalty=0.8),
    "negative_frequency": SamplingOptions(frequency_penalty=-2.0),
    "logit_bias": SamplingOptions(logit_bias=((17, 6.0), (42, -100.0), (7, 3.5))),
    "logprobs": SamplingOptions(logprobs=5, repetition_penalty=1.3),
}


def test_greedy_with_controls_matches_transformers_in_one_batch():
    hf = hf_model("tiny")
    driver = PlanDriver(make_runner(hf))
    rng = random.Random(13)
    prompts = {i: random_prompt(rng, 3 + 2 * i) for i in range(len(CASES))}
    options = dict(zip(prompts, CASES.values()))
    # seq 0 chunks its prompt over two steps
    _step(driver, new_seqs=[driver.new_seq(0, prompts[0], 2, options[0])]
          + [driver.new_seq(i, prompts[i], sampling=options[i]) for i in prompts if i])
    results = []
    while min(len(driver.tokens[i]) - len(prompts[i]) for i in prompts) < NUM_NEW:
        results.append(_step(driver, cached_seqs=[
            driver.cached_seq(i) for i in prompts
            if len(driver.tokens[i]) - len(prompts[i]) < NUM_NEW]))
    changed = []
    for i, name in enumerate(CASES):
        want, _ = _hf_generate(hf, prompts[i], options[i])
        assert driver.tokens[i][len(prompts[i]):] == want, name
        if want != _hf_generate(hf, prompts[i], SamplingOptions())[0]:
            changed.append(name)
    # the controls change what greedy picks (else the identity would prove little)
    assert set(changed) >= {"repetition_below_1", "presence_frequency", "negative_frequency",
                            "logit_bias"}, changed


def test_logprobs_are_log_softmax_of_the_reference_logits():
    hf = hf_model("tiny")
    driver = PlanDriver(make_runner(hf))
    prompt = random_prompt(random.Random(14), 6)
    options = CASES["logprobs"]
    sampled = [_step(driver, new_seqs=[driver.new_seq(1, prompt, sampling=options)]).sampled[0]]
    while len(sampled) < NUM_NEW:
        sampled.append(_step(driver, cached_seqs=[driver.cached_seq(1)]).sampled[0])
    tokens, logits = _hf_generate(hf, prompt, options)
    assert [t.token_id for t in sampled] == tokens
    reference = torch.log_softmax(logits.double(), dim=-1)  # raw: before the penalty
    for t, row in zip(sampled, reference):
        assert abs(t.logprob - row[t.token_id].item()) < 1e-4
        top = row.topk(5)
        assert list(t.top_token_ids) == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(t.top_logprobs, dtype=torch.float64), top.values,
                                   rtol=0, atol=1e-4)


def test_plain_seq_gets_no_logprobs_next_to_one_that_asks():
    driver = PlanDriver(make_runner(hf_model("tiny")))
    rng = random.Random(15)
    result = _step(driver, new_seqs=[
        driver.new_seq(1, random_prompt(rng, 4)),
        driver.new_seq(2, random_prompt(rng, 4), sampling=SamplingOptions(logprobs=0)),
        driver.new_seq(3, random_prompt(rng, 4), sampling=SamplingOptions(logprobs=2))])
    by_seq = {t.seq_id: t for t in result.sampled}
    assert by_seq[1].logprob is None and by_seq[1].top_token_ids == ()
    assert by_seq[2].logprob is not None and by_seq[2].top_token_ids == ()
    assert len(by_seq[3].top_token_ids) == len(by_seq[3].top_logprobs) == 2


@pytest.mark.parametrize("name", ["presence_frequency", "repetition"])
def test_readmission_rebuilds_counts_from_the_plan(name):
    """Preempted by recompute then re-admitted as a new seq (prompt + generated ids, the prompt
    length apart): the penalties continue exactly as if it had never left."""
    hf = hf_model("tiny")
    driver = PlanDriver(make_runner(hf))
    prompt = random_prompt(random.Random(16), 7)
    options = CASES[name]
    _step(driver, new_seqs=[driver.new_seq(1, prompt, sampling=options)])
    for _ in range(5):
        _step(driver, cached_seqs=[driver.cached_seq(1)])
    _step(driver, preempted_seq_ids=[1])
    driver.free += driver.tables.pop(1)
    readmitted = dataclasses.replace(driver.new_seq(1, driver.tokens[1], sampling=options),
                                     num_prompt_tokens=len(prompt))
    _step(driver, new_seqs=[readmitted])
    while len(driver.tokens[1]) - len(prompt) < NUM_NEW:
        _step(driver, cached_seqs=[driver.cached_seq(1)])
    assert driver.tokens[1][len(prompt):] == _hf_generate(hf, prompt, options)[0]


def test_logit_bias_id_out_of_vocabulary_is_a_plan_mismatch():
    from executor_svc.step import PlanMismatch
    runner = make_runner(hf_model("tiny"))
    driver = PlanDriver(runner)
    bad = driver.new_seq(1, [5, 6], sampling=SamplingOptions(logit_bias=((49152, 1.0),)))
    with pytest.raises(PlanMismatch, match="logit_bias"):
        runner.launch(StepPlan(1, new_seqs=[bad]))
    assert not len(runner.input_batch)


@pytest.mark.parametrize("num_cpu_blocks", [16, 0])  # preemption by swap, then by recompute
def test_real_scheduler_with_preemption_and_two_steps_in_flight(num_cpu_blocks):
    """The scheduler's plans (re-admissions after recompute preemption included: prompt and
    generated ids apart) against a runner launching step N+1 before step N is finished."""
    hf = hf_model("tiny")
    runner = make_runner(hf, num_gpu_blocks=12, num_cpu_blocks=num_cpu_blocks)
    sched = make_scheduler(runner.info, max_num_batched_tokens=16, max_num_seqs=6)
    rng = random.Random(17)
    cases = list(CASES.values())
    prompts, options = {}, {}
    for seq_id in range(1, 11):
        options[seq_id] = o = cases[seq_id % len(cases)]
        prompts[seq_id] = random_prompt(rng, rng.randint(1, 20))
        params = SamplingParams(presence_penalty=o.presence_penalty,
                                frequency_penalty=o.frequency_penalty,
                                repetition_penalty=o.repetition_penalty,
                                logit_bias=o.logit_bias, logprobs=o.logprobs)
        sched.add_seq(Sequence(seq_id, prompts[seq_id], params,
                               StoppingParams(max_tokens=rng.randint(6, 14)), eos_token_id=None,
                               max_model_len=512, arrival_time=float(seq_id)))
    link = RunnerLink(runner, overlap=True)
    readmitted = []  # penalised seqs sent anew with generated tokens
    send = link.send
    link.send = lambda message: (readmitted.extend(
        s.seq_id for s in message.new_seqs
        if s.num_prompt_tokens < len(s.token_ids) and s.sampling.presence_penalty), send(message))
    run = ScheduledRun(sched, link).run()
    if num_cpu_blocks:
        assert sched.num_preemptions_swap > 0
    else:
        assert sched.num_preemptions_recompute > 0 and readmitted
    assert link.launched_with_pending > 0
    for seq_id, out in run.outputs.items():
        assert out == _hf_generate(hf, prompts[seq_id], options[seq_id], len(out))[0], seq_id
