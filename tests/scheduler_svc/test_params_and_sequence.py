"""SamplingParams / StoppingParams validation and Sequence bookkeeping."""

import pytest

from scheduler_svc.errors import InvalidArgument
from scheduler_svc.sampling_params import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                           MAX_STOP_TOKEN_IDS, SamplingParams, StoppingParams)
from sched_factories import EOS, make_seq


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_top_p_message_is_exact():
    with pytest.raises(InvalidArgument, match=r"^top_p: must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5).validate()


def test_valid_sampling_params():
    SamplingParams(temperature=0.7, top_p=1.0, top_k=-1, min_p=1.0, seed=3).validate()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (5, 100)}, "stop_token_ids"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_stopping_params_name_the_bad_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        StoppingParams(**kwargs).validate(vocab_size=100)
    assert err.value.field == field


def test_unknown_stop_ids_message():
    with pytest.raises(InvalidArgument, match="unknown stop ids"):
        StoppingParams(stop_token_ids=(100,)).validate(vocab_size=100)
    StoppingParams(max_tokens=4, min_tokens=4, stop=("x",), stop_token_ids=(99,)).validate(100)


def test_stop_limits_are_inclusive():
    StoppingParams(stop=("x" * MAX_STOP_STRING_CHARS,) * MAX_STOP_STRINGS,
                   stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS))).validate(MAX_STOP_TOKEN_IDS)


@pytest.mark.parametrize("kwargs, field, message", [
    ({"stop": ("x",) * (MAX_STOP_STRINGS + 1)}, "stop",
     f"at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}"),
    ({"stop": ("x", "y" * (MAX_STOP_STRING_CHARS + 1))}, "stop",
     f"at most {MAX_STOP_STRING_CHARS} characters, stop[1] has {MAX_STOP_STRING_CHARS + 1}"),
    ({"stop_token_ids": (1,) * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
     f"at most {MAX_STOP_TOKEN_IDS} stop ids, got {MAX_STOP_TOKEN_IDS + 1}"),
])
def test_one_over_a_stop_limit_is_refused(kwargs, field, message):
    with pytest.raises(InvalidArgument) as err:
        StoppingParams(**kwargs).validate(vocab_size=100)
    assert err.value.field == field and message in str(err.value)


@pytest.mark.parametrize("num_ids", [2000, MAX_STOP_TOKEN_IDS])
def test_unknown_stop_ids_message_stays_short(num_ids):
    # ids are uint32 on the wire; the message must fit in any client's header limit
    ids = tuple(range(2**32 - num_ids, 2**32))
    with pytest.raises(InvalidArgument) as err:
        StoppingParams(stop_token_ids=ids).validate(vocab_size=100)
    assert err.value.field == "stop_token_ids" and len(str(err.value)) < 200
    if num_ids == MAX_STOP_TOKEN_IDS:
        assert str(err.value) == (
            f"stop_token_ids: {num_ids} unknown stop ids (vocab_size 100), first "
            f"{list(ids[:8])}")


def test_stop_string_messages_never_quote_the_strings():
    with pytest.raises(InvalidArgument) as err:
        StoppingParams(stop=("z" * 10**6,)).validate(vocab_size=100)
    assert len(str(err.value)) < 200


def test_sequence_tokens_and_effective_max_tokens():
    seq = make_seq(1, prompt_len=5, max_tokens=100, max_model_len=8)
    assert seq.num_prompt_tokens == 5 and seq.max_tokens == 3
    assert make_seq(2, prompt_len=5, max_tokens=None, max_model_len=8).max_tokens == 3
    assert make_seq(3, prompt_len=5, max_tokens=2, max_model_len=8).max_tokens == 2
    seq.token_ids.append(42)
    assert seq.num_tokens == 6 and seq.num_output_tokens == 1 and seq.token_ids[-1] == 42
    assert seq.prompt_token_ids == seq.token_ids[:5]


def test_sequence_length_limit_and_stop_token_set():
    """What the scheduler's per-token pre-check reads: num_tokens at which the seq stops by length,
    and every id that may stop it (EOS included, whatever ignore_eos and min_tokens say)."""
    assert make_seq(1, prompt_len=5, max_tokens=100, max_model_len=8).length_limit == 8
    assert make_seq(2, prompt_len=5, max_tokens=None, max_model_len=8).length_limit == 8
    assert make_seq(3, prompt_len=5, max_tokens=2, max_model_len=8).length_limit == 7
    seq = make_seq(4, stop_token_ids=(7, 9), ignore_eos=True, min_tokens=2)
    assert seq.stop_token_set == {7, 9, EOS}


@pytest.mark.parametrize("kwargs, field, message", [
    ({"presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "must be > 0 (1 is off), got 0.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "must be > 0"),
    ({"logprobs": 21}, "logprobs", "must be in [0, 20], got 21"),
    ({"logprobs": -1}, "logprobs", "must be in [0, 20]"),
    ({"logit_bias": ((100, 1.0),)}, "logit_bias", "1 token ids out of vocabulary (vocab_size "
                                                  "100), first [100]"),
    ({"logit_bias": ((5, 100.5),)}, "logit_bias", "biases must be in [-100, 100]"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias", "a token id is given twice"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias", "at most 300 tokens"),
])
def test_sampling_controls_name_the_bad_field(kwargs, field, message):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert err.value.field == field and message in str(err.value)


def test_valid_sampling_controls():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5,
                   logit_bias=tuple((i, -100.0) for i in range(100)), logprobs=20).validate(100)


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_names_n(n):
    from scheduler_svc.request import GenerateSpec, ModelLimits, validate_params
    with pytest.raises(InvalidArgument) as err:
        validate_params(GenerateSpec(prompt_token_ids=[1], n=n), ModelLimits(100, 64, None))
    assert err.value.field == "n"


# Each field's last accepted value and first refused one: what is accepted, the executor link
# carries (a 32-bit float that stays finite and, where 0 means off, does not round to 0; an int32
# top_k; a uint64 seed); what is refused names the field, in a short message.
@pytest.mark.parametrize("field, accepted, refused", [
    ("top_k", 2**31 - 1, 2**31),
    ("top_k", -1, -2),
    ("temperature", 3.4028234663852886e38, 3.5e38),
    ("temperature", 0.0, -1e-300),
    ("repetition_penalty", 3.4028234663852886e38, 1e39),
    ("repetition_penalty", 1.5e-45, 1e-46),
    ("top_p", 1.5e-45, 1e-46),
    ("seed", 2**64 - 1, 2**64),
    ("logprobs", 20, 21),
    ("top_k", 0, 10**400),
])
def test_sampling_bounds_are_what_the_executor_link_carries(field, accepted, refused):
    from scheduler_svc import wire
    from scheduler_svc.plan import NewSeqPlan, StepPlan
    ok = SamplingParams(**{field: accepted})
    ok.validate(vocab_size=100)
    wire.plan_to_proto(StepPlan(1, new_seqs=[NewSeqPlan(1, [1], [0], 0, 1, ok, 2**64 - 1)]))
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: refused}).validate(vocab_size=100)
    assert err.value.field == field and len(str(err.value)) < 120


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"min_tokens": 2**32}, "min_tokens"),
    ({"max_tokens": 10**400}, "max_tokens"),
    ({"stop_token_ids": (10**400,)}, "stop_token_ids"),
])
def test_stopping_bounds_are_the_public_apis_uint32(kwargs, field):
    StoppingParams(max_tokens=2**32 - 1, min_tokens=2**32 - 1).validate(vocab_size=100)
    with pytest.raises(InvalidArgument) as err:
        StoppingParams(**kwargs).validate(vocab_size=100)
    assert err.value.field == field and len(str(err.value)) < 120


def test_nan_and_inf_are_refused_by_every_float_field():
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):
        for value in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(InvalidArgument) as err:
                SamplingParams(**{field: value}).validate()
            assert err.value.field == field
    for value in (float("nan"), float("inf")):
        with pytest.raises(InvalidArgument) as err:
            SamplingParams(logit_bias=((1, value),)).validate(vocab_size=100)
        assert err.value.field == "logit_bias"


def test_huge_ids_are_refused_in_a_short_message():
    from scheduler_svc.request import GenerateSpec, ModelLimits, resolve_prompt
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(logit_bias=tuple((10**4000 + i, 1.0) for i in range(8))).validate(100)
    assert err.value.field == "logit_bias" and "a 13288-bit integer" in str(err.value)
    assert len(str(err.value)) < 400
    with pytest.raises(InvalidArgument) as err:
        resolve_prompt(GenerateSpec(prompt_token_ids=[1, 2**32, 10**4000]), None,
                       ModelLimits(100, 64, None))
    assert err.value.field == "prompt.token_ids" and len(str(err.value)) < 200


def test_a_prompt_that_is_not_unicode_is_refused_by_name():
    """A lone surrogate: both APIs' parsers refuse one, a Python caller of the engine may not."""
    from scheduler_svc.request import GenerateSpec, RequestLimits, check_sizes
    limits = RequestLimits()
    for spec, field in [(GenerateSpec(prompt_text="a\ud800b"), "prompt.text"),
                        (GenerateSpec(chat=[{"role": "user", "content": "ok"},
                                            {"role": "user", "content": "\udfff"}]),
                         "prompt.chat.messages[1].content")]:
        with pytest.raises(InvalidArgument) as err:
            check_sizes(spec, limits)
        assert err.value.field == field and "Unicode" in str(err.value)
    check_sizes(GenerateSpec(prompt_text="é 😀"), limits)
