"""The OpenAI request bodies mapped to GenerateSpecs: every parameter the engine has (logprobs
included, their ranges and chat's top_logprobs needing logprobs), n samples with reproducible
distinct seeds, the prompt forms, and controls the engine lacks refused by name unless neutral."""
import json

import pytest
from pydantic import ValidationError

from scheduler_svc import openai_protocol
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.openai_protocol import (MAX_EXTRA_FIELDS, ChatCompletionRequest, Choice,
                                           CompletionRequest, apply, chat_specs,
                                           completion_specs, ignored_fields, param_name, usage,
                                           warn_ignored)
from scheduler_svc.request import FinishEvent, TokenEvent
from scheduler_svc.sampling_params import MAX_LOGPROBS
from scheduler_svc.sequence import FinishReason

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi", **fields})


def test_chat_maps_every_engine_parameter():
    [spec] = chat_specs(chat(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                             max_tokens=9, min_tokens=2, stop="END", stop_token_ids=[5, 6],
                             ignore_eos=True, user="u1"), "r")
    assert spec.chat == USER and spec.request_id == "r-0"
    s, st = spec.sampling, spec.stopping
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.05, 7)
    assert (st.max_tokens, st.min_tokens, st.stop, st.stop_token_ids, st.ignore_eos) == \
        (9, 2, ("END",), (5, 6), True)


def test_defaults_are_openais():
    [spec] = chat_specs(chat(), "r")
    s, st = spec.sampling, spec.stopping
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (1.0, 1.0, -1, 0.0, None)
    assert (st.max_tokens, st.stop, st.ignore_eos) == (None, (), False)
    assert chat_specs(chat(top_k=0), "r")[0].sampling.top_k == -1  # vLLM: 0 is off too


def test_max_completion_tokens_wins_over_max_tokens():
    [spec] = chat_specs(chat(max_tokens=5, max_completion_tokens=7), "r")
    assert spec.stopping.max_tokens == 7


def test_n_samples_are_one_engine_request_seeded_seed_plus_i():
    """The engine seeds sample i with seed + i; an n over its limit is split, each part's seed
    that of its first sample."""
    [spec] = chat_specs(chat(n=3, seed=2**64 - 2), "r")
    assert (spec.n, spec.sampling.seed, spec.request_id) == (3, 2**64 - 2, "r-0")
    specs = chat_specs(chat(n=40, seed=5), "r")
    assert [(s.n, s.sampling.seed, s.request_id) for s in specs] == [
        (16, 5, "r-0"), (16, 21, "r-16"), (8, 37, "r-32")]
    assert chat_specs(chat(n=2), "r")[0].sampling.seed is None
    assert chat_specs(chat(seed=-1), "r")[0].sampling.seed == 2**64 - 1  # int64 seeds too


def test_completion_prompt_forms_and_choice_order():
    assert completion_specs(completion(prompt="a b"), "r")[0].prompt_text == "a b"
    assert completion_specs(completion(prompt=[1, 2, 3]), "r")[0].prompt_token_ids == [1, 2, 3]
    specs = completion_specs(completion(prompt=[[1, 2], [3]], n=2), "r")
    assert [(s.prompt_token_ids, s.n) for s in specs] == [([1, 2], 2), ([3], 2)]
    assert [s.request_id for s in specs] == ["r-0", "r-2"]  # choices 0-1 and 2-3
    texts = completion_specs(completion(prompt=["x", "y"]), "r")
    assert [s.prompt_text for s in texts] == ["x", "y"]
    with pytest.raises(InvalidArgument, match="prompt: must not be empty"):
        completion_specs(completion(prompt=[]), "r")
    with pytest.raises(InvalidArgument) as info:
        completion_specs(completion(prompt=["x"] * 3, n=128), "r")
    assert info.value.field == "prompt"


def test_penalties_and_logit_bias_reach_the_engine():
    [spec] = chat_specs(chat(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                             logit_bias={"7": 2.5, "3": -100}), "r")
    s = spec.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert s.logit_bias == ((3, -100.0), (7, 2.5))
    [spec] = completion_specs(completion(presence_penalty=None, repetition_penalty=None), "r")
    assert (spec.sampling.presence_penalty, spec.sampling.repetition_penalty) == (0.0, 1.0)
    with pytest.raises(InvalidArgument) as info:
        chat_specs(chat(logit_bias={"the": 1}), "r")
    assert info.value.field == "logit_bias"


def test_logprobs_reach_the_engine():
    """Chat: logprobs true with top_logprobs k (none: 0); completions: logprobs k, up to the
    engine's 20 as vLLM allows (OpenAI's legacy limit is 5)."""
    def engine_logprobs(body):
        specs = chat_specs(body, "r") if isinstance(body, ChatCompletionRequest) \
            else completion_specs(body, "r")
        return {s.sampling.logprobs for s in specs}
    assert engine_logprobs(chat(logprobs=True, top_logprobs=5, n=20)) == {5}
    assert engine_logprobs(chat(logprobs=True)) == {0}
    assert engine_logprobs(chat(logprobs=False, top_logprobs=0)) == {None}
    assert engine_logprobs(chat(logprobs=None)) == engine_logprobs(chat()) == {None}
    assert engine_logprobs(completion(logprobs=0)) == {0}
    assert engine_logprobs(completion(logprobs=MAX_LOGPROBS)) == {MAX_LOGPROBS}
    assert engine_logprobs(completion()) == {None}


def test_top_logprobs_needs_logprobs_true():
    for fields in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": False}):
        with pytest.raises(InvalidArgument, match="needs logprobs: true") as info:
            chat_specs(chat(**fields), "r")
        assert info.value.field == "top_logprobs"


@pytest.mark.parametrize("body,fields,param", [
    (chat, {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    (chat, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (chat, {"logprobs": 3}, "logprobs"),
    (completion, {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    (completion, {"logprobs": -1}, "logprobs")])
def test_logprobs_out_of_range_fail_validation_naming_them(body, fields, param):
    with pytest.raises(ValidationError) as info:
        body(**fields)
    assert info.value.errors()[0]["loc"] == (param,)


def test_neutral_values_of_missing_controls_are_accepted():
    chat_specs(chat(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0,
                    logit_bias={}, logprobs=False, top_logprobs=0), "r")
    chat_specs(chat(presence_penalty=None, logit_bias=None, logprobs=None), "r")
    completion_specs(completion(logprobs=None, presence_penalty=0), "r")


@pytest.mark.parametrize("fields,param", [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content")])
def test_chat_features_not_served_are_refused(fields, param):
    with pytest.raises(InvalidArgument) as info:
        chat_specs(chat(**fields), "r")
    assert info.value.field == param


def test_chat_text_parts_are_joined_and_text_format_accepted():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    [spec] = chat_specs(chat(messages=[{"role": "user", "content": parts}],
                             response_format={"type": "text"}, tool_choice="none"), "r")
    assert spec.chat == [{"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize("fields", [{"echo": True}, {"suffix": "x"}, {"best_of": 3}])
def test_completion_features_not_served_are_refused(fields):
    with pytest.raises(InvalidArgument) as info:
        completion_specs(completion(**fields), "r")
    assert info.value.field == next(iter(fields))


def test_bad_types_and_ranges_fail_validation():
    for fields in ({"n": 0}, {"n": 129}, {"seed": 2**64}, {"temperature": "hot"}):
        with pytest.raises(ValidationError):
            chat(**fields)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({})  # messages are required


def test_engine_fields_are_named_as_the_api_names_them():
    body = chat(max_completion_tokens=3)
    assert param_name("prompt.chat", body) == "messages"
    assert param_name("prompt.chat.messages[2].role", body) == "messages[2].role"
    assert param_name("max_tokens", body) == "max_completion_tokens"
    assert param_name("max_tokens", chat(max_tokens=3)) == "max_tokens"
    assert param_name("prompt.token_ids", completion()) == "prompt"
    assert param_name("top_p", completion()) == "top_p"


def test_usage_counts_each_prompt_once_and_every_sample():
    choices = [Choice() for _ in range(4)]  # 2 prompts x n=2
    for i, (prompt, generated) in enumerate([(5, 3), (5, 4), (7, 1), (7, 2)]):
        apply(choices[i], TokenEvent(1, "a", 0))
        apply(choices[i], FinishEvent(FinishReason.EOS, prompt, generated, "b"))
    assert usage(choices, n=2) == {"prompt_tokens": 12, "completion_tokens": 10,
                                   "total_tokens": 22}
    assert choices[0].text == "ab" and choices[0].finish_reason == "stop"


def chat_json(**fields) -> ChatCompletionRequest:
    """As the server parses a body: from its JSON text."""
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": USER, **fields}))


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "4"}, "max_tokens"), ({"max_tokens": 4.0}, "max_tokens"),
    ({"n": True}, "n"), ({"stream": 1}, "stream"), ({"stream": "true"}, "stream"),
    ({"temperature": "1"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"seed": "7"}, "seed"), ({"top_k": 4.5}, "top_k"), ({"ignore_eos": 0}, "ignore_eos"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"), ({"logprobs": 1}, "logprobs"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage")])
def test_json_types_are_strict(fields, param):
    with pytest.raises(ValidationError) as info:
        chat_json(**fields)
    loc = info.value.errors()[0]["loc"]
    assert "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") == param


def test_floats_take_json_integers_and_refuse_nan_and_infinity():
    [spec] = chat_specs(chat_json(temperature=1, top_p=1, presence_penalty=0,
                                  logit_bias={"5": 1}), "r")
    assert spec.sampling.temperature == 1.0 and spec.sampling.logit_bias == ((5, 1.0),)
    body = json.dumps({"messages": USER, "temperature": 1}).replace("1}", "NaN}")
    for text in (body, body.replace("NaN", "Infinity"), body.replace("NaN", "1e400")):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate_json(text)


@pytest.mark.parametrize("key", [" 5", "5 ", "٥", "+5", "-5", "05", "5.0", "0x5", "1e3", "",
                                 "5\n", "12345678901", "9" * 5000])
def test_logit_bias_keys_are_plain_decimal_token_ids(key):
    with pytest.raises(InvalidArgument) as info:
        chat_specs(chat_json(logit_bias={key: 1}), "r")
    assert info.value.field == "logit_bias" and len(str(info.value)) < 200


def test_logit_bias_keys_up_to_uint32_reach_the_engine():
    [spec] = chat_specs(chat_json(logit_bias={"0": 1, "4294967295": -1, "10": 2.5}), "r")
    assert spec.sampling.logit_bias == ((0, 1.0), (10, 2.5), (4294967295, -1.0))


@pytest.mark.parametrize("fields", [
    {"guided_decoding_backend": "xgrammar"}, {"echo": True}, {"best_of": 2},
    {"use_beam_search": True}, {"length_penalty": 0.5}, {"include_stop_str_in_output": True},
    {"skip_special_tokens": False}, {"spaces_between_special_tokens": False},
    {"truncate_prompt_tokens": 5}, {"prompt_logprobs": 0}, {"add_generation_prompt": False},
    {"continue_final_message": True}, {"chat_template": "{{ x }}"},
    {"chat_template_kwargs": {"enable_thinking": True}}, {"documents": [{"t": "x"}]},
    {"priority": 1}, {"allowed_token_ids": [1]}, {"bad_words": ["x"]},
    {"return_tokens_as_token_ids": True}, {"add_special_tokens": True},
    {"service_tier": "flex"}, {"store": True}, {"reasoning_effort": "low"},
    {"modalities": ["text", "audio"]}, {"prediction": {"type": "content", "content": "x"}},
    {"audio": {"voice": "x"}}, {"web_search_options": {"search_context_size": "low"}},
    {"function_call": "f"},
    {"cache_salt": "s"}, {"logits_processors": ["x"]}, {"vllm_xargs": {"a": 1}}])
def test_chat_fields_the_engine_lacks_are_refused_by_name(fields):
    with pytest.raises(InvalidArgument) as info:
        chat_specs(chat_json(**fields), "r")
    assert info.value.field == next(iter(fields))


def test_neutral_values_of_fields_the_engine_lacks_are_accepted():
    chat_specs(chat_json(
        guided_json=None, guided_choice=[], guided_regex="", structured_outputs={}, echo=False,
        best_of=1, use_beam_search=False, length_penalty=1, include_stop_str_in_output=False,
        skip_special_tokens=True, spaces_between_special_tokens=True, truncate_prompt_tokens=None,
        prompt_logprobs=None, add_generation_prompt=True, continue_final_message=False,
        chat_template=None, chat_template_kwargs={}, documents=None, priority=0,
        add_special_tokens=False, service_tier="auto", store=False, modalities=["text"],
        parallel_tool_calls=True, function_call="none", reasoning_effort=None), "r")
    chat_specs(chat_json(n=3, best_of=3, parallel_tool_calls=False), "r")
    completion_specs(CompletionRequest.model_validate_json(json.dumps(
        {"prompt": "Hi", "add_special_tokens": True, "response_format": {"type": "text"},
         "guided_json": None, "priority": 0})), "r")


@pytest.mark.parametrize("fields", [{"add_special_tokens": False},
                                    {"include_stop_str_in_output": True}])
def test_completion_fields_the_engine_lacks_are_refused_by_name(fields):
    body = CompletionRequest.model_validate_json(json.dumps({"prompt": "Hi", **fields}))
    with pytest.raises(InvalidArgument) as info:
        completion_specs(body, "r")
    assert info.value.field == next(iter(fields))


def test_unknown_fields_are_ignored_and_logged_once_per_name(caplog):
    name = "an_unknown_field_of_this_test"
    with caplog.at_level("WARNING", logger="scheduler_svc.openai_protocol"):
        for _ in range(3):
            body = chat_json(**{name: {"x": 1}, "user": "u", "metadata": {}, "store": False})
            [spec] = chat_specs(body, "r")
            assert ignored_fields(body) == [name, "metadata"]
            warn_ignored(ignored_fields(body))
    assert spec.chat == USER
    assert sum(name in r.getMessage() for r in caplog.records) == 1


def test_extra_fields_are_bounded_and_so_are_the_names_logged(caplog, monkeypatch):
    extra = {f"x{i}": 0 for i in range(MAX_EXTRA_FIELDS + 1)}
    with pytest.raises(InvalidArgument, match=f"one of {MAX_EXTRA_FIELDS + 1} fields beyond"):
        chat_specs(chat_json(**extra), "r")
    chat_specs(chat_json(**dict(list(extra.items())[:MAX_EXTRA_FIELDS])), "r")
    monkeypatch.setattr(openai_protocol, "_warned_names", set())
    with caplog.at_level("WARNING", logger="scheduler_svc.openai_protocol"):
        for i in range(4):  # 4 x 100 new names: the first 256 are logged, then none
            warn_ignored([f"n{i}-{j}" for j in range(100)])
    assert len(openai_protocol._warned_names) == 256 and len(caplog.records) == 3
