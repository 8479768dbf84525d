"""The OpenAI API's request bodies (pydantic), their mapping to GenerateSpecs (a feature the engine
lacks is refused unless neutral, never dropped), and the response and chunk bodies built from
engine events. No HTTP, no gRPC, no torch.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from scheduler_svc.errors import InvalidArgument
from scheduler_svc.request import MAX_N as MAX_ENGINE_N
from scheduler_svc.request import FinishEvent, GenerateSpec, TokenEvent
from scheduler_svc.sampling_params import (DEFAULTABLE_SAMPLING_FIELDS, MAX_LOGPROBS,
                                           SamplingParams, StoppingParams, TokenLogprobs)
from scheduler_svc.sequence import FinishReason
from scheduler_svc.structured_output import (StructuredOutput, check_spec_size, compact_json,
                                             structured_output, tool_call_output)
from scheduler_svc.tool_parsers import (PARSER_CLASSES, NamedToolCall, RequiredToolCalls,
                                        ToolCallDelta, ToolCallStream)

log = logging.getLogger(__name__)

# OpenAI's own bound on `n`. The engine samples up to request.MAX_N of them from one prefill
# (parallel sampling); a larger n is split into engine requests of at most that many.
MAX_N = 128
# Choices of one API request (a /v1/completions batch of prompts, times n).
MAX_CHOICES = 256
_SEED_MODULUS = 2**64
# What OpenAI and vLLM send for a logprob of -inf, which JSON cannot carry.
_MIN_LOGPROB = -9999.0

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.ABORTED: "abort",  # vLLM's word for a request ended by the server
}


# JSON types as OpenAI checks them: "max_tokens": "4" or "stream": 1 is a 400 (pydantic's lax mode
# would take them), while a float takes a JSON integer (temperature 1). NaN and Infinity, which
# pydantic's JSON reader accepts, are refused (allow_inf_nan=False on every model).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
_CONFIG = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _CONFIG

    include_usage: Bool = False


class _SamplingRequest(BaseModel):
    """What both endpoints share. Unknown fields are accepted and ignored, as vLLM does (logged
    once per name); known ones the engine lacks are refused unless neutral (`_UNSUPPORTED`)."""

    model_config = _CONFIG

    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=-2**63, lt=2**64)
    temperature: Float | None = None  # None: OpenAI's default, 1.0
    top_p: Float | None = None
    max_tokens: Int | None = None
    presence_penalty: Float | None = 0.0
    frequency_penalty: Float | None = 0.0
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None

    def num_logprobs(self) -> int | None:
        """The engine's logprobs: None, or how many alternatives each token comes with."""
        raise NotImplementedError


class ContentPart(BaseModel):
    model_config = _CONFIG

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _CONFIG

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's: checked by _tool_calls_of
    tool_call_id: str | None = None  # a tool's answer: which call it answers


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None  # checked by _tools_of
    tool_choice: Any = None  # "auto" when tools are given, else "none" (vLLM's defaults)
    parallel_tool_calls: Bool | None = None  # None: true
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="before")
    @classmethod
    def _default_tool_choice(cls, data):
        """tool_choice's default, and only what is read of it (the parsed body keeps it)."""
        if not isinstance(data, dict):
            return data
        choice = data.get("tool_choice")
        if choice is None:
            choice = "auto" if data.get("tools") else "none"
        elif isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            kind = choice.get("type", "function")
            choice = {"type": kind if isinstance(kind, str) else None,
                      "function": {"name": name if isinstance(name, str) else None}}
        elif not isinstance(choice, str):
            choice = False  # refused by chat_specs
        return {**data, "tool_choice": choice}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    # OpenAI's legacy limit is 5; vLLM's (and the engine's) 20
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool | None = False
    suffix: str | None = None
    best_of: Int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


_STRUCTURED = "not supported (structured output takes response_format or structured_outputs)"
_NOT_SUPPORTED = "not supported"
_OFF = (None, False, "", [], {})  # what leaves a feature off
_ON = (None, True)  # what leaves on what the engine always does
# Fields of OpenAI's and vLLM's APIs that the engine does not implement: (the values that change
# nothing, why any other is refused). Any other value is a 400 naming the field.
_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    **{name: (_OFF, _STRUCTURED) for name in (
        "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern")},
    **{name: (_OFF, _NOT_SUPPORTED) for name in (
        "use_beam_search", "include_stop_str_in_output", "truncate_prompt_tokens",
        "prompt_logprobs", "allowed_token_ids", "bad_words", "return_tokens_as_token_ids",
        "return_token_ids", "logits_processors", "vllm_xargs", "kv_transfer_params",
        "mm_processor_kwargs", "cache_salt", "thinking_token_budget", "store", "prediction",
        "audio", "web_search_options", "reasoning_effort")},
    "skip_special_tokens": (_ON, "only true (special tokens are never in the text)"),
    "spaces_between_special_tokens": (_ON, "only true is supported"),
    "length_penalty": ((None, 1), "beam search is not supported"),
    "priority": ((None, 0), "priority scheduling is not supported"),
    "service_tier": ((None, "auto", "default"), "only \"auto\" or \"default\" is supported"),
}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED,
    **{name: (_OFF, _NOT_SUPPORTED) for name in (
        "echo", "continue_final_message", "chat_template", "chat_template_kwargs", "documents")},
    "add_special_tokens": ((None, False), "only false (the chat template places them)"),
    "add_generation_prompt": (_ON, "only true is supported"),
    "modalities": ((None, ["text"]), "only [\"text\"] is supported"),
    "function_call": ((None, "none", "auto"), "the legacy function_call is not supported: "
                      "use tool_choice"),
}
_UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED,
    "add_special_tokens": (_ON, "only true is supported"),
}
# Fields beyond the API's own (vLLM's that the engine lacks, and unknown ones) a body may carry:
# generous for a client that sends every vLLM field at its default, and a bound on the work
# and the log lines they cause.
MAX_EXTRA_FIELDS = 128
# Names of ignored unknown fields already logged: a warning once per name (a client that sends one
# with every request must not flood the log), up to this many names.
_MAX_WARNED_NAMES = 256
_warned_names: set[str] = set()


def _same(value, neutral) -> bool:
    """JSON equality: Python's == takes true for 1 and false for 0; JSON does not."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _unsupported(req: _SamplingRequest) -> dict[str, tuple[tuple, str]]:
    """Fields of `req`'s endpoint the engine lacks: (neutral values, why another is refused)."""
    if isinstance(req, ChatCompletionRequest):
        return {**_UNSUPPORTED_CHAT,
                "best_of": ((None, 1, req.n), f"only equal to n ({req.n}) is supported")}
    return _UNSUPPORTED_COMPLETION


def _refuse_unsupported(req: _SamplingRequest) -> None:
    """A 400 for a known field the engine lacks, set to anything but a neutral value, or for more
    than MAX_EXTRA_FIELDS fields beyond the API's; unknown fields are ignored (`ignored_fields`)."""
    extra = req.model_extra or {}
    if len(extra) > MAX_EXTRA_FIELDS:  # first, so that what follows is O(limit)
        raise InvalidArgument(next(iter(extra))[:64], f"one of {len(extra)} fields beyond the "
                              f"API's; at most {MAX_EXTRA_FIELDS} are accepted")
    unsupported = _unsupported(req)
    for name, value in extra.items():
        if name in unsupported:
            neutral, reason = unsupported[name]
            if not any(_same(value, v) for v in neutral):
                raise InvalidArgument(name, reason)


def ignored_fields(req: _SamplingRequest) -> list[str]:
    """The fields of `req` this server does not know, which it ignores as vLLM does."""
    unsupported = _unsupported(req)
    return [name for name in req.model_extra or {}
            if name not in unsupported and name not in _STRUCTURED_FIELDS]


def warn_ignored(names: Sequence[str]) -> None:
    """Logs the ignored field names not logged before, while fewer than _MAX_WARNED_NAMES were."""
    new = [name for name in dict.fromkeys(names) if name not in _warned_names]
    new = new[:max(_MAX_WARNED_NAMES - len(_warned_names), 0)]
    if new:
        _warned_names.update(new)
        log.warning("ignored request fields this server does not know: %s",
                    ", ".join(repr(name[:64]) for name in new[:16]))


def _refuse_chat_extras(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise InvalidArgument("functions", "the legacy functions are not supported: use tools")
    _refuse_unsupported(req)


def _refuse_completion_extras(req: CompletionRequest) -> None:
    if req.echo:
        raise InvalidArgument("echo", "not supported")
    if req.suffix:
        raise InvalidArgument("suffix", "not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidArgument("best_of", f"only equal to n ({req.n}) is supported")
    _refuse_unsupported(req)


def _sampling(req: _SamplingRequest, sample: int,
              structured: StructuredOutput | None = None) -> SamplingParams:
    """Sample `sample` of `n`: seed + sample, so that a seeded request is reproducible and its
    samples differ (as vLLM derives its parallel samples' seeds). The engine validates ranges
    and names the field (penalties, logit_bias ids against the vocabulary)."""
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=None if req.seed is None else (req.seed + sample) % _SEED_MODULUS,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=req.num_logprobs(),
        structured=structured,
    )


# A token id as a logit_bias key: at most ten ASCII digits (uint32) written as a JSON integer
# literal would be, without its sign: no spaces, "+", leading zeros or other scripts' digits.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as the engine's sorted (id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidArgument("logit_bias", "keys must be token ids in decimal digits (at "
                                  f"most 10, no sign, spaces or leading zeros), got {key[:16]!r}")
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


def _stopping(req: _SamplingRequest, max_tokens: int | None) -> StoppingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return StoppingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
                          stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos)


def _fan_out(req: _SamplingRequest, request_id: str, prompts: list[dict],
             max_tokens: int | None, structured: StructuredOutput | None) -> list[GenerateSpec]:
    """An engine request of n samples per prompt (several of at most the engine's MAX_N when n
    is larger, the k-th sample's seed seed + k as the engine gives it). Choice index = prompt
    index * n + sample: the specs' n added up before it, plus the event's sample_index."""
    stopping = _stopping(req, max_tokens)
    unset = _unset_fields(req, max_tokens)
    return [GenerateSpec(**prompt, sampling=_sampling(req, first, structured), stopping=stopping,
                         request_id=f"{request_id}-{i * req.n + first}",
                         n=min(MAX_ENGINE_N, req.n - first), unset=unset)
            for i, prompt in enumerate(prompts) for first in range(0, req.n, MAX_ENGINE_N)]


# vLLM's structured_outputs keys: the format (one of them) and options. Options that change
# nothing here are accepted (the JSON grammar never adds whitespace; there is no fallback engine).
_SO_FORMATS = frozenset(("json", "regex", "choice", "grammar", "json_object"))
_SO_NEUTRAL = {"disable_fallback": (None, True, False),
               "disable_any_whitespace": (None, True, False),
               "disable_additional_properties": (None, False), "whitespace_pattern": (None,),
               "structural_tag": (None,), "_backend": (None,), "backend": (None,)}
# vLLM's names before structured_outputs (removed from vLLM in 0.12, which ignores them since)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = frozenset(("structured_outputs", "response_format", *_GUIDED))


def structured_output_of(req: _SamplingRequest) -> StructuredOutput | None:
    """The request's output format, from response_format, vLLM's structured_outputs or its older
    guided_* fields: at most one of them may set one. Raises InvalidArgument naming the field."""
    extra = req.model_extra or {}
    found = [so for so in (_response_format(getattr(req, "response_format", None)
                                            if isinstance(req, ChatCompletionRequest)
                                            else extra.get("response_format")),
                           _structured_outputs(extra.get("structured_outputs")))
             if so is not None]
    found += [structured_output(kind, extra[name], name) for name, kind in _GUIDED.items()
              if extra.get(name) not in _OFF]
    if len(found) > 1:
        raise InvalidArgument(found[1].field, f"sets an output format and {found[0].field} "
                              "another: set one")
    return found[0] if found else None


def _response_format(value) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument("response_format", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return structured_output("json_object", None, "response_format")
    if kind != "json_schema":
        raise InvalidArgument("response_format.type", "must be \"text\", \"json_object\" or "
                              f"\"json_schema\", got {str(kind)[:32]!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument("response_format.json_schema", "must be an object")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidArgument("response_format.json_schema.strict", "must be a boolean")
    if "schema" not in spec:
        raise InvalidArgument("response_format.json_schema.schema", "is required")
    # strict or not, the schema is enforced (as vLLM does)
    return structured_output("json", spec["schema"], "response_format.json_schema.schema")


def _structured_outputs(value) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument("structured_outputs", "must be an object")
    found = []
    for key, item in value.items():
        name = f"structured_outputs.{str(key)[:32]}"
        if key in _SO_FORMATS:
            if item is not None and item is not False:  # an empty value is refused, not off
                found.append(structured_output(key, item, name))
        elif key not in _SO_NEUTRAL:
            raise InvalidArgument(name, "unknown; structured_outputs takes json, regex, choice, "
                                  "grammar or json_object")
        elif not any(_same(item, v) for v in _SO_NEUTRAL[key]):
            raise InvalidArgument(name, _NOT_SUPPORTED)
    if len(found) > 1:
        raise InvalidArgument(found[1].field, f"and {found[0].field} both set a format: set one")
    if found and found[0].kind == "json_object" and value.get("json_object") is not True:
        raise InvalidArgument(found[0].field, "must be true when set")
    return found[0] if found else None


# --- tools --------------------------------------------------------------------------------------

# OpenAI's limit on a request's tools; each one's parameters schema is bounded as other schemas
# are (MAX_SPEC_BYTES), names as request ids are.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 256
# Tool calls of one assistant message in a conversation
MAX_MESSAGE_TOOL_CALLS = 128
_TOOL_CHOICE_FORM = ('must be "none", "auto", "required" or {"type": "function", "function": '
                     '{"name": ...}}')
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _tools_of(tools: list | None) -> list[dict] | None:
    """The request's tools, checked, as the chat template takes them (as sent: each
    {"type": "function", "function": {"name", "description", "parameters"}})."""
    if tools is None:
        return None
    if not tools:
        raise InvalidArgument("tools", "must not be empty: give at least one tool, or leave "
                              "tools out")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]", names)
    return tools


def _check_tool(tool, field: str, names: set[str]) -> None:
    if not isinstance(tool, dict):
        raise InvalidArgument(field, 'must be an object: {"type": "function", "function": {...}}')
    if tool.get("type", "function") != "function":
        raise InvalidArgument(f"{field}.type", 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{field}.function", "must be an object with the function's name")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{field}.function.name", "is required: a non-empty string")
    if len(name) > MAX_TOOL_NAME_CHARS or not name.isprintable():
        raise InvalidArgument(f"{field}.function.name", f"at most {MAX_TOOL_NAME_CHARS} "
                              "printable characters")
    if name in names:
        raise InvalidArgument(f"{field}.function.name", f"{name!r} names another tool too: "
                              "names must differ")
    names.add(name)
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise InvalidArgument(f"{field}.function.description", "must be a string")
    if function.get("parameters") is not None:
        _check_parameters(function["parameters"], f"{field}.function.parameters")


def _check_parameters(schema, field: str) -> None:
    """A JSON schema of the arguments object, within the size bound. Deeper checks are the
    grammar engine's, where tool_choice enforces it."""
    if not isinstance(schema, dict):
        raise InvalidArgument(field, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise InvalidArgument(field, 'must be a JSON schema of "type": "object" (the arguments '
                              "are an object)")
    if not isinstance(schema.get("properties", {}), dict):
        raise InvalidArgument(f"{field}.properties", "must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidArgument(f"{field}.required", "must be a list of property names")
    check_spec_size(compact_json(schema, field), field)


def _tool_calls_of(calls: list, field: str) -> list[dict]:
    """An assistant message's tool calls as templates take them (vLLM's): each call as sent,
    its arguments parsed from their JSON text ({} when empty)."""
    if len(calls) > MAX_MESSAGE_TOOL_CALLS:
        raise InvalidArgument(field, f"at most {MAX_MESSAGE_TOOL_CALLS} calls, got {len(calls)}")
    out = []
    for j, call in enumerate(calls):
        where = f"{field}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidArgument(where, 'must be an object: {"id": ..., "type": "function", '
                                  '"function": {"name": ..., "arguments": ...}}')
        if call.get("type", "function") != "function":
            raise InvalidArgument(f"{where}.type", 'must be "function"')
        if not isinstance(call.get("id", ""), str):
            raise InvalidArgument(f"{where}.id", "must be a string")
        function = call["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidArgument(f"{where}.function.name", "is required: a non-empty string")
        arguments = _arguments_of(function.get("arguments"), f"{where}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _arguments_of(arguments, field: str):
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, (dict, list)):
        return arguments
    if not isinstance(arguments, str):
        raise InvalidArgument(field, "must be a string of JSON")
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        raise InvalidArgument(field, "is not valid JSON") from None


def _output_format(req: ChatCompletionRequest, tools: list[dict] | None
                   ) -> StructuredOutput | None:
    """The output's format: the one tool_choice "required" or a named function enforces (a
    JSON schema of the calls, as vLLM builds it), else response_format's or structured_outputs'
    (tools being free with "auto" and "none"); both is a 400."""
    choice = req.tool_choice
    if choice not in ("none", "auto", "required") and not isinstance(choice, dict):
        raise InvalidArgument("tool_choice", _TOOL_CHOICE_FORM)
    if choice != "none" and tools is None:
        raise InvalidArgument("tool_choice", "needs tools: give tools, or leave tool_choice out")
    other = structured_output_of(req)
    if choice in ("none", "auto"):
        return other
    if choice == "required":
        schema = _required_schema(tools, req.parallel_tool_calls is not False)
        output = tool_call_output(schema, "tools")
    else:
        index = _named_tool(choice, tools)
        schema = tools[index]["function"].get("parameters") or _EMPTY_PARAMETERS
        output = tool_call_output(schema, f"tools[{index}].function.parameters")
    if other is not None:
        raise InvalidArgument(other.field, "sets an output format and tool_choice another (its "
                              "tool calls): set one")
    return output


def _named_tool(choice: dict, tools: list[dict]) -> int:
    """The index of the tool a named tool_choice names."""
    if choice.get("type", "function") != "function":
        raise InvalidArgument("tool_choice.type", 'must be "function"')
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidArgument("tool_choice.function.name", "is required: the name of one of "
                              "the tools")
    for i, tool in enumerate(tools):
        if tool["function"]["name"] == name:
            return i
    raise InvalidArgument("tool_choice.function.name", f"{name[:64]!r} names none of the tools")


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": a list of one or more {"name", "parameters"}
    objects, each of one tool, the tools' $defs moved to the top where their $refs point. Two
    bounds vLLM leaves out: no keys beside those two (the parser reads no others), and without
    parallel calls a list of one (vLLM keeps only the first; this spares the tokens)."""
    defs: dict = {}
    items = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        local = parameters.get("$defs")
        if isinstance(local, dict):
            for name, definition in local.items():
                if defs.setdefault(name, definition) != definition:
                    raise InvalidArgument(f"tools[{i}].function.parameters.$defs.{name[:64]}",
                                          "another tool defines it differently; with "
                                          "tool_choice \"required\" the tools' $defs are one set")
            parameters = {k: v for k, v in parameters.items() if k != "$defs"}
        items.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolCalling:
    """How a chat request's output is read for tool calls: `mode` "auto" (the --tool-call-parser
    `parser` finds them in what the model chose to write), "required" or "named" (the grammar
    enforced them; `function` is the one named)."""

    mode: str
    function: str | None = None
    parser: str | None = None
    parallel: bool = True

    def stream(self) -> ToolCallStream:
        if self.mode == "named":
            return NamedToolCall(self.function)
        if self.mode == "required":
            return RequiredToolCalls(self.parallel)
        return PARSER_CLASSES[self.parser](self.parallel)


def tool_calling(body: _SamplingRequest, auto_parser: str | None) -> ToolCalling | None:
    """How `body`'s output is read for tool calls (None: it is not), once chat_specs accepted it;
    `auto_parser` is --tool-call-parser with --enable-auto-tool-choice, else None: then "auto"
    is refused, as vLLM refuses it."""
    choice = getattr(body, "tool_choice", "none")
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    if choice == "none":
        return None
    if choice == "auto":
        if auto_parser is None:
            raise InvalidArgument("tool_choice", '"auto" (the default with tools) needs the '
                                  "scheduler started with --enable-auto-tool-choice and "
                                  '--tool-call-parser; or send "none", "required" or a named '
                                  "function")
        return ToolCalling("auto", parser=auto_parser, parallel=parallel)
    if choice == "required":
        return ToolCalling("required", parallel=parallel)
    return ToolCalling("named", function=choice["function"]["name"])


def _unset_fields(req: _SamplingRequest, max_tokens: int | None) -> frozenset[str]:
    """The defaultable fields the body leaves out (or null): the model's defaults apply there,
    as vLLM's to_sampling_params takes them for a None."""
    unset = {name for name in DEFAULTABLE_SAMPLING_FIELDS if getattr(req, name) is None}
    if max_tokens is None:
        unset.add("max_tokens")
    return frozenset(unset)


def chat_specs(req: ChatCompletionRequest, request_id: str) -> list[GenerateSpec]:
    """The engine requests of a chat completion; raises InvalidArgument naming the parameter."""
    _refuse_chat_extras(req)
    if req.top_logprobs and not req.logprobs:  # 0 alone is accepted, as vLLM does
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    if not req.messages:
        raise InvalidArgument("messages", "must not be empty")
    tools = _tools_of(req.tools)
    structured = _output_format(req, tools)
    chat = [_message_of(m, i) for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    return _fan_out(req, request_id, [{"chat": chat, "tools": tools}], max_tokens, structured)


def _message_of(message: ChatMessage, index: int) -> dict:
    """A message as the chat template takes it (vLLM's): its text, and its name, tool call id
    and tool calls (their arguments parsed) where it has them."""
    out = {"role": message.role, "content": _text_of(message, index)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        out["tool_calls"] = _tool_calls_of(message.tool_calls, f"messages[{index}].tool_calls")
    return out


def _text_of(message: ChatMessage, index: int) -> str:
    """Text parts joined by newlines (as vLLM); any other part is refused."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidArgument(f"messages[{index}].content",
                                  f"only text parts are supported, got {part.type!r}")
    return "\n".join(part.text for part in message.content)


def completion_specs(req: CompletionRequest, request_id: str) -> list[GenerateSpec]:
    """The engine requests of a completion (one of n samples per prompt); raises InvalidArgument."""
    _refuse_completion_extras(req)
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise InvalidArgument("prompt" if len(prompts) > 1 else "n",
                              f"at most {MAX_CHOICES} choices (prompts times n), got "
                              f"{len(prompts)} x {req.n}")
    return _fan_out(req, request_id, prompts, req.max_tokens, structured_output_of(req))


def _prompts(prompt) -> list[dict]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        return [{"prompt_text": prompt}]
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    if isinstance(prompt[0], str):
        return [{"prompt_text": p} for p in prompt]
    return [{"prompt_token_ids": list(p)} for p in prompt]


def param_name(field: str, req: _SamplingRequest) -> str:
    """The API's name of an engine field named in an InvalidArgument."""
    if field.startswith("prompt.chat"):
        return "messages" + field[len("prompt.chat.messages"):] \
            if field.startswith("prompt.chat.messages") else "messages"
    if field.startswith("prompt"):
        return "prompt"
    if field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return field


# --- responses ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogprobsEntry:
    """One generated token's logprobs, and where its text starts in the choice's text (the
    characters released before it)."""

    token_id: int
    logprobs: TokenLogprobs
    text_offset: int


@dataclass
class Choice:
    """One sample's output so far. `logprobs` has an entry per generated token when the request
    asked for them: every token usage counts, as Generate returns them and as vLLM does, so the
    tokens of a stop string whose text is cut off keep theirs."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    # a chat choice read for tool calls: the reader, the text that is no call, each call whole
    tools: ToolCallStream | None = None
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """What one event adds to a choice: text (with tools, the text that is no call), its
    token's logprobs when they were asked, and what it adds to tool calls."""

    text: str
    logprobs: tuple[LogprobsEntry, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens once per prompt (not per sample), completion tokens of every sample."""
    prompt = sum(c.prompt_tokens for i, c in enumerate(choices) if i % n == 0)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def apply(choice: Choice, event: TokenEvent | FinishEvent) -> Delta:
    """Adds `event` to `choice`; returns what it adds."""
    entries: tuple[LogprobsEntry, ...] = ()
    if isinstance(event, FinishEvent):
        choice.finish_reason = FINISH_REASONS[event.reason]
        choice.prompt_tokens, choice.completion_tokens = (event.prompt_tokens,
                                                          event.completion_tokens)
    elif event.logprobs is not None:
        entries = (LogprobsEntry(event.token_id, event.logprobs, len(choice.text)),)
        choice.logprobs.append(entries[0])
    choice.text += event.text
    if choice.tools is None:
        return Delta(event.text, entries)
    return _apply_tools(choice, event, entries)


def _apply_tools(choice: Choice, event: TokenEvent | FinishEvent,
                 entries: tuple[LogprobsEntry, ...]) -> Delta:
    """The event's text through the choice's tool call reader; a choice that ends ("stop")
    having called a tool finishes with "tool_calls" (vLLM's: "stop" after a named call)."""
    final = isinstance(event, FinishEvent)
    parsed = choice.tools.finish(event.text) if final else choice.tools.feed(event.text)
    choice.content += parsed.content
    for delta in parsed.tool_calls:
        if delta.index == len(choice.tool_calls):
            choice.tool_calls.append(ToolCallDelta(delta.index))
        choice.tool_calls[delta.index].merge(delta)
    if final and choice.tool_calls and choice.finish_reason == "stop":
        choice.finish_reason = choice.tools.calls_finish_reason
    return Delta(parsed.content, entries, tuple(parsed.tool_calls))


class TokenTexts:
    """Each token's own text, as vLLM shows it in logprobs: the decode of that id alone, special
    tokens included (a piece of a longer UTF-8 character decodes to U+FFFD), or "token_id:<id>"
    for a model without a tokenizer. Cached: at most one string per vocabulary entry, and the top
    alternatives of consecutive tokens repeat."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._texts[token_id] = text
        return text


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


@dataclass(frozen=True)
class Reply:
    """What every response and chunk of one request carries; `token_texts` is set when the
    request asked for logprobs."""

    id: str
    model: str
    created: int
    token_texts: TokenTexts | None = None
    tools: ToolCalling | None = None

    @classmethod
    def new(cls, prefix: str, request_id: str, model: str,
            token_texts: TokenTexts | None = None, tools: ToolCalling | None = None) -> Reply:
        return cls(f"{prefix}-{request_id}", model, int(time.time()), token_texts, tools)

    def new_choice(self) -> Choice:
        return Choice(tools=None if self.tools is None else self.tools.stream())

    def body(self, kind: str, **fields) -> dict:
        """A response or chunk of `kind` ("object") with this reply's id, time and model."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                **fields}


class ChatFormat:
    """chat.completion bodies and chat.completion.chunk events."""

    id_prefix = "chatcmpl"

    @staticmethod
    def response(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("chat.completion",
                          choices=[{"index": i, "message": ChatFormat.message(c),
                                    "logprobs": ChatFormat.logprobs(reply, c.logprobs),
                                    "finish_reason": c.finish_reason}
                                   for i, c in enumerate(choices)],
                          usage=usage(choices, n))

    @staticmethod
    def opening(reply: Reply, index: int) -> dict:
        """The first chunk of a choice: its role, as OpenAI sends it."""
        return ChatFormat._chunk(reply, index, {"role": "assistant", "content": ""}, None, None)

    @staticmethod
    def message(choice: Choice) -> dict:
        """The assistant's message; with tool calls, their content is the text before them,
        null when there is none ("" for required and named calls, as vLLM's)."""
        if choice.tools is None:
            return {"role": "assistant", "content": choice.text}
        if not choice.tool_calls:
            return {"role": "assistant", "content": choice.content}
        return {"role": "assistant", "content": choice.content or choice.tools.empty_content,
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}
                               for call in choice.tool_calls]}

    @staticmethod
    def chunk(reply: Reply, index: int, delta: Delta, finish_reason: str | None) -> dict:
        if delta.tool_calls:
            content = {"tool_calls": [_tool_call_chunk(d) for d in delta.tool_calls]}
            if delta.text:
                content = {"content": delta.text, **content}
        elif finish_reason is not None and not delta.text:
            content = {}
        else:
            content = {"content": delta.text}
        logprobs = ChatFormat.logprobs(reply, delta.logprobs) if delta.logprobs else None
        return ChatFormat._chunk(reply, index, content, finish_reason, logprobs)

    @staticmethod
    def _chunk(reply: Reply, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None) -> dict:
        return reply.body("chat.completion.chunk",
                          choices=[{"index": index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": finish_reason}])

    @staticmethod
    def usage_chunk(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("chat.completion.chunk", choices=[], usage=usage(choices, n))

    @staticmethod
    def logprobs(reply: Reply, entries: Sequence[LogprobsEntry]) -> dict | None:
        """{"content": [token, logprob, bytes, top_logprobs] per token}; top_logprobs are the k
        most likely, most likely first, as OpenAI means them (vLLM lists the sampled token first
        when it is not one of them)."""
        texts = reply.token_texts
        if texts is None:
            return None
        return {"content": [{**_chat_logprob(texts, e.token_id, e.logprobs.logprob),
                             "top_logprobs": [_chat_logprob(texts, token_id, logprob)
                                              for token_id, logprob in e.logprobs.top]}
                            for e in entries]}


def _tool_call_chunk(delta: ToolCallDelta) -> dict:
    """A call's delta as OpenAI streams it: index, id, type and name first (arguments ""), then
    index and a fragment of the arguments."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def _chat_logprob(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    token = texts(token_id)
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


class CompletionFormat:
    """text_completion bodies and stream events."""

    id_prefix = "cmpl"

    @staticmethod
    def response(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("text_completion",
                          choices=[{"index": i, "text": c.text,
                                    "logprobs": CompletionFormat.logprobs(reply, c.logprobs),
                                    "finish_reason": c.finish_reason}
                                   for i, c in enumerate(choices)],
                          usage=usage(choices, n))

    @staticmethod
    def opening(reply: Reply, index: int) -> dict | None:
        return None

    @staticmethod
    def chunk(reply: Reply, index: int, delta: Delta, finish_reason: str | None) -> dict:
        logprobs = CompletionFormat.logprobs(reply, delta.logprobs) if delta.logprobs else None
        return reply.body("text_completion",
                          choices=[{"index": index, "text": delta.text, "logprobs": logprobs,
                                    "finish_reason": finish_reason}])

    @staticmethod
    def usage_chunk(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("text_completion", choices=[], usage=usage(choices, n))

    @staticmethod
    def logprobs(reply: Reply, entries: Sequence[LogprobsEntry]) -> dict | None:
        """OpenAI's legacy lists: tokens, token_logprobs, top_logprobs, text_offset."""
        texts = reply.token_texts
        if texts is None:
            return None
        return {"tokens": [texts(e.token_id) for e in entries],
                "token_logprobs": [_finite(e.logprobs.logprob) for e in entries],
                "top_logprobs": [_completion_top(texts, e) for e in entries],
                "text_offset": [e.text_offset for e in entries]}


def _completion_top(texts: TokenTexts, entry: LogprobsEntry) -> dict[str, float]:
    """{token: logprob} of the sampled token, then of the top ones (OpenAI's "up to logprobs + 1"
    entries, vLLM's order); of two tokens with one text, the first stays."""
    top = {texts(entry.token_id): _finite(entry.logprobs.logprob)}
    for token_id, logprob in entry.logprobs.top:
        top.setdefault(texts(token_id), _finite(logprob))
    return top
