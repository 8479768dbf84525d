"""Structured output on the scheduler side, no processes: each format's spec from both APIs to
llguidance grammar text (bad ones refused naming the field), the grammar check at admission
(errors and the time limit, the event loop serving meanwhile), and the plan carrying the grammar
and a constrained seq's generated tokens to the executor."""
import asyncio
import json
import time

import pytest

from executor_svc import wire as executor_wire
from protos import generate_pb2
from scheduler_svc import openai_protocol as api
from scheduler_svc import wire
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.plan import NewSeqPlan, StepPlan
from scheduler_svc.request import RequestLimits
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.structured_output import (MAX_CHOICES, MAX_SPEC_BYTES, GrammarChecker,
                                             structured_output)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_each_format_becomes_llguidance_grammar_text():
    for kind, value in [("json", SCHEMA), ("json", json.dumps(SCHEMA)), ("json_object", None),
                        ("regex", "[a-z]+"), ("choice", ["a", 'b "q"']),
                        ("grammar", 'start: "x" | "y"'), ("grammar", 'root ::= "x" | "y"')]:
        so = structured_output(kind, value, "f")
        assert so.kind == kind and so.field == "f" and so.grammar


@pytest.mark.parametrize("kind,value,says", [
    ("json", "{nope", "not valid JSON"),
    ("json", [1], "JSON schema object"),
    ("json", {"a": float("inf")}, "non-finite"),
    ("regex", 5, "must be a string"),
    ("regex", "  ", "must not be empty"),
    ("regex", "a" * (MAX_SPEC_BYTES + 1), "at most"),
    ("regex", "é" * (MAX_SPEC_BYTES // 2 + 1), "at most"),  # bytes, not characters
    ("choice", [], "non-empty list"),
    ("choice", ["a", 3], "non-empty strings"),
    ("choice", ["a"] * (MAX_CHOICES + 1), "at most"),
    ("grammar", "root ::= (", "GBNF"),
])
def test_bad_values_are_refused_naming_the_field(kind, value, says):
    with pytest.raises(InvalidArgument, match=says) as err:
        structured_output(kind, value, "the.field")
    assert err.value.field == "the.field"


def chat(**body):
    return api.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **body})


def test_openai_response_format_and_vllm_extras_map_to_one_format():
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": SCHEMA, "strict": True}}}, "json",
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, "regex",
         "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar",
         "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object",
         "structured_outputs.json_object"),
        ({"guided_json": SCHEMA}, "json", "guided_json"),
        ({"guided_regex": "a"}, "regex", "guided_regex"),
        ({"guided_choice": ["a"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'start: "a"'}, "grammar", "guided_grammar"),
    ]
    for body, kind, field in cases:
        [spec] = api.chat_specs(chat(**body), "r")
        assert (spec.sampling.structured.kind, spec.sampling.structured.field) == (kind, field)
        assert not api.ignored_fields(chat(**body))
    for body in ({}, {"response_format": {"type": "text"}}, {"guided_json": None}):
        assert api.chat_specs(chat(**body), "r")[0].sampling.structured is None
    completion = api.CompletionRequest.model_validate(
        {"prompt": "hi", "n": 3, "response_format": {"type": "json_object"}})
    assert all(s.sampling.structured.kind == "json_object"
               for s in api.completion_specs(completion, "r"))


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                 "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"structured_outputs": {"regex": "a", "json": SCHEMA}}, "structured_outputs.json"),
    ({"structured_outputs": {"typo": 1}}, "structured_outputs.typo"),
    ({"structured_outputs": {"disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structural_tag": "{}"}, "structural_tag"),
])
def test_conflicting_or_unsupported_structured_fields_are_refused(body, field):
    with pytest.raises(InvalidArgument) as err:
        api.chat_specs(chat(**body), "r")
    assert err.value.field == field


def test_generate_request_structured_output_from_the_wire():
    req = generate_pb2.GenerateRequest(text="hi")
    req.structured_output.choice.choices.extend(["a", "b"])
    spec = wire.spec_from_proto(req, "r", RequestLimits())
    assert (spec.sampling.structured.kind, spec.sampling.structured.field) == (
        "choice", "structured_output.choice")
    req.structured_output.json_schema = json.dumps(SCHEMA)
    assert wire.spec_from_proto(req, "r", RequestLimits()).sampling.structured.kind == "json"
    req.structured_output.json_object = False
    with pytest.raises(InvalidArgument, match="must be true"):
        wire.spec_from_proto(req, "r", RequestLimits())
    req.ClearField("structured_output")
    req.structured_output.SetInParent()
    with pytest.raises(InvalidArgument, match="exactly one"):
        wire.spec_from_proto(req, "r", RequestLimits())


def test_the_plan_carries_the_grammar_and_the_generated_tokens():
    so = structured_output("regex", "[0-9]+", "f")
    prompt, generated = [5, 6, 7, 8], [11, 12]
    constrained = NewSeqPlan(1, prompt + generated, [0, 1], 6, 0,
                             SamplingParams(structured=so), 3, num_prompt_tokens=4)
    free = NewSeqPlan(2, prompt + generated, [2, 3], 6, 0, SamplingParams(), 3,
                      num_prompt_tokens=4)
    plan = executor_wire.plan_from_proto(wire.plan_to_proto(StepPlan(1, new_seqs=[constrained,
                                                                                  free])))
    a, b = plan.new_seqs
    assert a.sampling.grammar == so.grammar and a.first_position == 4
    assert a.token_ids == generated  # the executor replays these; the prompt stays home
    assert b.sampling.grammar == "" and b.first_position == 6 and b.token_ids == []


class Hf:
    """The tokenizer's JSON and EOS, as GrammarChecker reads them from a transformers one."""

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer, self.eos_token_id = tokenizer.hf_tokenizer.backend_tokenizer, 2


# anyOf 100 objects of 20 properties: a compile far longer than the test's 5 ms limit
SLOW = {"anyOf": [{"type": "object", "properties": {f"k{j}_{i}": {"type": "integer"}
                                                    for j in range(20)},
                   "required": [f"k0_{i}"]} for i in range(100)]}


def test_the_grammar_check_refuses_bad_and_slow_grammars_without_blocking_the_loop(tokenizer):
    async def main():
        checker = GrammarChecker(Hf(tokenizer), 49152, timeout_s=5.0)
        await checker.check(structured_output("json", SCHEMA, "ok"))  # also waits the tokenizer
        with pytest.raises(InvalidArgument, match="unclosed group") as err:
            await checker.check(structured_output("regex", "(a", "bad.regex"))
        assert err.value.field == "bad.regex"
        with pytest.raises(InvalidArgument) as err:
            await checker.check(structured_output("grammar", "start: nowhere", "bad.grammar"))
        assert err.value.field == "bad.grammar"
        checker.timeout_s = 0.005
        gaps, done = [], asyncio.Event()

        async def bystander():  # the loop must keep serving while the grammar compiles
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.002)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        task = asyncio.ensure_future(bystander())
        with pytest.raises(InvalidArgument, match="--grammar-timeout") as err:
            await checker.check(structured_output("json", SLOW, "slow.schema"))
        assert err.value.field == "slow.schema"
        await asyncio.sleep(0.2)  # the compile thread finishes meanwhile
        done.set()
        await task
        checker.close()
        return gaps

    gaps = asyncio.run(main())
    assert max(gaps) < 0.05, max(gaps)
