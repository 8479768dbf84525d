"""Penalties, logit bias and logprobs through Generate on real processes (issue 13): greedy
float32 output token-identical to transformers' generate with the matching logits processors,
logprobs within 1e-4 of a log-softmax of transformers' logits, and bad values refused."""
from __future__ import annotations

import random

import grpc
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from protos import generate_pb2
from tests.integration.harness import streamed_tokens
from tests.integration.hf_reference import hf_model

pytestmark = pytest.mark.slow

TINY = "preset:tiny"
NUM_NEW = 16


@pytest.fixture(scope="module")
def stub(tiny_services):
    with grpc.insecure_channel(tiny_services.scheduler_address) as channel:
        yield tiny_services.stub(channel)


class _OpenAIPenalties(LogitsProcessor):
    """logit -= frequency * count + presence * (count > 0), over the generated tokens only."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.num_prompt:]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@torch.inference_mode()
def _hf(prompt, presence=0.0, frequency=0.0, repetition=1.0, logit_bias=None):
    """transformers' greedy tokens and raw logits per step."""
    gen = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0, repetition_penalty=repetition,
                           sequence_bias={(t,): b for t, b in (logit_bias or {}).items()} or None,
                           return_dict_in_generate=True, output_logits=True)
    processors = LogitsProcessorList([_OpenAIPenalties(len(prompt), presence, frequency)])
    out = hf_model(TINY).generate(torch.tensor([prompt]), attention_mask=torch.ones(
        1, len(prompt), dtype=torch.long), generation_config=gen, logits_processor=processors)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def _generate(stub, prompt, **sampling):
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(**sampling),
        stopping=generate_pb2.StoppingCriteria(max_tokens=NUM_NEW, ignore_eos=True))
    return streamed_tokens(stub.Generate(req, timeout=300))


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49152) for _ in range(rng.randint(4, 24))]


CASES = [
    dict(repetition=0.7),
    dict(repetition=1.5),
    dict(presence=-1.5, frequency=0.8),
    dict(frequency=-2.0),
    dict(logit_bias={17: 6.0, 42: -100.0, 7: 3.5}),
    dict(repetition=1.2, presence=0.5, logit_bias={300: 2.0}),
]


def _request(case) -> dict:
    fields = {"presence_penalty": case.get("presence", 0.0),
              "frequency_penalty": case.get("frequency", 0.0),
              "logit_bias": case.get("logit_bias", {})}
    if "repetition" in case:
        fields["repetition_penalty"] = case["repetition"]
    return fields


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_with_controls_matches_transformers(stub, case):
    prompt = _prompt(case)
    got = [m.token_id for m in _generate(stub, prompt, **_request(CASES[case]))]
    assert got == _hf(prompt, **CASES[case])[0]
    assert all(m.logprob is None for m in _generate(stub, prompt))  # not asked


def test_logprobs_match_log_softmax_of_transformers_logits(stub):
    prompt = _prompt(40)
    messages = _generate(stub, prompt, logprobs=5, repetition_penalty=1.3)
    tokens, logits = _hf(prompt, repetition=1.3)
    assert [m.token_id for m in messages] == tokens
    reference = torch.log_softmax(logits.double(), dim=-1)  # the raw model's, before penalties
    for m, row in zip(messages, reference):
        assert abs(m.logprob - row[m.token_id].item()) < 1e-4
        top = row.topk(5)
        assert [t.token_id for t in m.top_logprobs] == top.indices.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(m.top_logprobs, top.values.tolist())) < 1e-4
    only = _generate(stub, prompt, logprobs=0)
    assert all(m.logprob is not None and not m.top_logprobs for m in only)


@pytest.mark.parametrize("sampling, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={49152: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_values_are_invalid_argument_naming_the_field(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, [1, 2, 3], **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
