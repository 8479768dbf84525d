"""The model's generation config on the scheduler side: its defaults fill what a request leaves
unset, alike over gRPC and the OpenAI API (vLLM's --generation-config auto), `vllm` turns them
off, and its other EOS ids stop requests as stop tokens unless ignore_eos."""
import asyncio
import logging

import pytest

from protos import generate_pb2
from scheduler_svc import main
from scheduler_svc.admission import Admission
from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.openai_protocol import (ChatCompletionRequest, CompletionRequest, chat_specs,
                                           completion_specs)
from scheduler_svc.request import GenerateSpec, ModelLimits, RequestLimits, prepare
from scheduler_svc.sampling_params import DEFAULTABLE_FIELDS, GenerationDefaults
from scheduler_svc.wire import ExecutorDescription, spec_from_proto

# Qwen3's published defaults, and a max_new_tokens
QWEN3_LIKE = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
                                repetition_penalty=1.05, max_tokens=40)
LIMITS = ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=2,
                     eos_stop_token_ids=(7, 9), defaults=QWEN3_LIKE)


def _grpc(**fields) -> GenerateSpec:
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]))
    for name, value in fields.items():
        target = req.stopping if name in ("max_tokens", "ignore_eos", "stop_token_ids") \
            else req.sampling
        if name == "stop_token_ids":
            target.stop_token_ids.extend(value)
        else:
            setattr(target, name, value)
    return spec_from_proto(req, "r", RequestLimits())


def _openai(**fields) -> GenerateSpec:
    (spec,) = completion_specs(CompletionRequest(prompt=[5, 6], **fields), "r")
    return spec


def _resolved(spec: GenerateSpec, limits: ModelLimits = LIMITS) -> tuple:
    prepared = prepare(spec, None, limits)
    s, st = prepared.sampling, prepared.stopping
    return (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, st.max_tokens,
            st.stop_token_ids)


def test_a_request_that_sets_nothing_takes_every_default_on_both_apis():
    assert _grpc().unset == _openai().unset == DEFAULTABLE_FIELDS
    expected = (0.6, 0.95, 20, 0.0, 1.05, 40, (7, 9))
    assert _resolved(_grpc()) == _resolved(_openai()) == expected


@pytest.mark.parametrize("fields, expected", [
    # an explicit value, even the API's own default, is the request's
    (dict(temperature=0.0), (0.0, 0.95, 20, 0.0, 1.05, 40)),
    (dict(top_p=1.0, top_k=0), (0.6, 1.0, -1, 0.0, 1.05, 40)),
    (dict(min_p=0.2, repetition_penalty=1.0), (0.6, 0.95, 20, 0.2, 1.0, 40)),
    (dict(max_tokens=5), (0.6, 0.95, 20, 0.0, 1.05, 5)),
])
def test_what_a_request_sets_wins_alike_over_grpc_and_http(fields, expected):
    grpc, http = _resolved(_grpc(**fields)), _resolved(_openai(**fields))
    # approx: gRPC's floats are 32-bit
    assert grpc[:6] == pytest.approx(expected) and http[:6] == pytest.approx(expected)


def test_an_explicit_null_over_http_is_unset():
    spec = _openai(temperature=None, max_tokens=None)
    assert {"temperature", "max_tokens"} <= spec.unset
    (chat,) = chat_specs(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=3), "r")
    assert "max_tokens" not in chat.unset and "temperature" in chat.unset


def test_without_model_defaults_each_api_keeps_its_own():
    """gRPC's unset temperature is greedy, OpenAI's 1.0, when the model sets no defaults."""
    plain = ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=2)
    assert _resolved(_grpc(), plain)[:6] == (0.0, 1.0, -1, 0.0, 1.0, None)
    assert _resolved(_openai(), plain)[:6] == (1.0, 1.0, -1, 0.0, 1.0, None)


def test_the_models_other_eos_ids_stop_unless_ignore_eos():
    assert _resolved(_grpc(stop_token_ids=[9, 11]))[6] == (9, 11, 7)
    assert _resolved(_grpc(ignore_eos=True))[6] == ()
    assert _resolved(_openai(ignore_eos=True, stop_token_ids=[11]))[6] == (11,)


def test_the_models_eos_ids_do_not_count_against_the_requests_stop_id_limit():
    many = list(range(10, 10 + 90))
    limits = ModelLimits(vocab_size=2000, max_model_len=64, eos_token_id=2,
                         eos_stop_token_ids=tuple(range(1000, 1100)))
    spec = spec_from_proto(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5]),
        stopping=generate_pb2.StoppingCriteria(stop_token_ids=many * 11 + many[:34])),
        "r", RequestLimits())
    assert len(spec.stopping.stop_token_ids) == 1024
    assert len(prepare(spec, None, limits).stopping.stop_token_ids) == 1124


def test_a_default_max_tokens_is_checked_as_the_requests_own():
    """min_tokens above the model's max_new_tokens is refused naming min_tokens."""
    with pytest.raises(InvalidArgument, match="min_tokens: must be <= max_tokens \\(40\\)"):
        prepare(_openai(min_tokens=50), None, LIMITS)


def _description(**defaults) -> ExecutorDescription:
    return ExecutorDescription("m", "fp", "float32", 4, 64, 0, 64, 100, "", "cpu", 1,
                               eos_token_ids=(2, 7, 9),
                               generation_defaults=GenerationDefaults(**defaults))


def _admission(mode: str) -> Admission:
    return Admission(EngineConfig(generation_config=mode))


def test_attach_applies_the_defaults_under_auto_and_logs_them_once(caplog):
    admission = _admission("auto")
    with caplog.at_level(logging.INFO, logger="scheduler_svc.admission"):
        asyncio.run(admission.load_model(_description(temperature=0.6, top_k=20)))
        asyncio.run(admission.load_model(_description(temperature=0.6, top_k=20)))
    assert admission.limits.defaults == GenerationDefaults(temperature=0.6, top_k=20)
    # no tokenizer here: every EOS id of the generation config is a stop id
    assert admission.limits.eos_token_id is None
    assert admission.limits.eos_stop_token_ids == (2, 7, 9)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("Default sampling parameters have been overridden" in m for m in lines) == 1
    assert lines.count("Using default sampling params from model (gRPC and OpenAI APIs): "
                       "{'temperature': 0.6, 'top_k': 20}") == 1
    assert sum("adds EOS ids [2, 7, 9]" in m for m in lines) == 1


def test_generation_config_vllm_keeps_the_apis_defaults_and_the_eos_ids(caplog):
    admission = _admission("vllm")
    with caplog.at_level(logging.INFO, logger="scheduler_svc.admission"):
        asyncio.run(admission.load_model(_description(temperature=0.6)))
    assert admission.limits.defaults == GenerationDefaults()
    assert admission.limits.eos_stop_token_ids == (2, 7, 9)
    assert "not applied (--generation-config vllm): {'temperature': 0.6}" in caplog.text
    assert "overridden" not in caplog.text


@pytest.mark.parametrize("defaults, field", [
    (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=2**40), "top_k"), (dict(max_tokens=2**40), "max_tokens"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
])
def test_a_default_no_request_may_have_fails_the_attach_naming_it(defaults, field):
    with pytest.raises(RuntimeError, match=f"generation config has a default no request may "
                                           f"have \\({field}: .*--generation-config vllm"):
        asyncio.run(_admission("auto").load_model(_description(**defaults)))
    asyncio.run(_admission("vllm").load_model(_description(**defaults)))  # not applied: served


def test_the_flag_defaults_to_auto_and_takes_its_environment(monkeypatch):
    assert main.parse_config([]).engine.generation_config == "auto"
    assert main.parse_config(["--generation-config", "vllm"]).engine.generation_config == "vllm"
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_GENERATION_CONFIG", "vllm")
    assert main.parse_config([]).engine.generation_config == "vllm"
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER_GENERATION_CONFIG", "model")
    with pytest.raises(SystemExit):
        main.parse_config([])
