"""The OpenAI API's request bodies (pydantic models), their mapping to GenerateSpecs, and the
response and stream-chunk bodies built from engine events. No HTTP, no gRPC, no torch.

A parameter the engine cannot honour yet is refused with InvalidArgument naming it, unless it has
its neutral value: nothing a client sets is silently dropped (see `_NOT_YET_CHAT`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.errors import InvalidArgument
from scheduler_svc.request import MAX_N as MAX_ENGINE_N
from scheduler_svc.request import FinishEvent, GenerateSpec, TokenEvent
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.sequence import FinishReason

# OpenAI's own bound on `n`. The engine samples up to request.MAX_N of them from one prefill
# (parallel sampling); a larger n is split into engine requests of at most that many.
MAX_N = 128
# Choices of one API request (a /v1/completions batch of prompts, times n).
MAX_CHOICES = 256
_SEED_MODULUS = 2**64

FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.ABORTED: "abort",  # vLLM's word for a request ended by the server
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """What both endpoints share. Unknown fields are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    max_tokens: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


# Controls the engine has but this API does not return yet (logprobs need token strings in the
# responses), per endpoint: (parameter, whether a value is neutral, the neutral values in words).
# Anything else is refused, never ignored.
_NOT_YET_CHAT = (("logprobs", lambda v: not v, "false"), ("top_logprobs", lambda v: not v, "0"))
_NOT_YET_COMPLETIONS = (("logprobs", lambda v: v is None, "null"),)


def _refuse_not_yet(req: _SamplingRequest, not_yet: tuple) -> None:
    for name, is_neutral, neutral in not_yet:
        value = getattr(req, name)
        if not is_neutral(value):
            raise InvalidArgument(name, f"not supported yet (only {neutral}), got {value!r}")


def _refuse_chat_extras(req: ChatCompletionRequest) -> None:
    if req.tools or req.functions:
        raise InvalidArgument("tools" if req.tools else "functions",
                              "tool calling is not supported")
    if req.tool_choice not in (None, "none", "auto"):
        raise InvalidArgument("tool_choice", "tool calling is not supported")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")


def _refuse_completion_extras(req: CompletionRequest) -> None:
    if req.echo:
        raise InvalidArgument("echo", "not supported")
    if req.suffix:
        raise InvalidArgument("suffix", "not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidArgument("best_of", f"only equal to n ({req.n}) is supported")


def _sampling(req: _SamplingRequest, sample: int) -> SamplingParams:
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
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as the engine's sorted (id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), float(value)))
        except ValueError:
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {key!r}") from None
    return tuple(sorted(pairs))


def _stopping(req: _SamplingRequest, max_tokens: int | None) -> StoppingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return StoppingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
                          stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos)


def _fan_out(req: _SamplingRequest, request_id: str, prompts: list[dict],
             max_tokens: int | None) -> list[GenerateSpec]:
    """An engine request of n samples per prompt (several of at most the engine's MAX_N when n
    is larger, the k-th sample's seed seed + k as the engine gives it). Choice index = prompt
    index * n + sample: the specs' n added up before it, plus the event's sample_index."""
    stopping = _stopping(req, max_tokens)
    return [GenerateSpec(**prompt, sampling=_sampling(req, first), stopping=stopping,
                         request_id=f"{request_id}-{i * req.n + first}",
                         n=min(MAX_ENGINE_N, req.n - first))
            for i, prompt in enumerate(prompts) for first in range(0, req.n, MAX_ENGINE_N)]


def chat_specs(req: ChatCompletionRequest, request_id: str) -> list[GenerateSpec]:
    """The engine requests of a chat completion; raises InvalidArgument naming the parameter."""
    _refuse_not_yet(req, _NOT_YET_CHAT)
    _refuse_chat_extras(req)
    if not req.messages:
        raise InvalidArgument("messages", "must not be empty")
    chat = [{"role": m.role, "content": _text_of(m, i)} for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    return _fan_out(req, request_id, [{"chat": chat}], max_tokens)


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
    _refuse_not_yet(req, _NOT_YET_COMPLETIONS)
    _refuse_completion_extras(req)
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise InvalidArgument("prompt" if len(prompts) > 1 else "n",
                              f"at most {MAX_CHOICES} choices (prompts times n), got "
                              f"{len(prompts)} x {req.n}")
    return _fan_out(req, request_id, prompts, req.max_tokens)


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

@dataclass
class Choice:
    """One sample's output so far."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens once per prompt (not per sample), completion tokens of every sample."""
    prompt = sum(c.prompt_tokens for i, c in enumerate(choices) if i % n == 0)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def apply(choice: Choice, event: TokenEvent | FinishEvent) -> str:
    """Adds `event` to `choice`; returns the text it releases."""
    if isinstance(event, FinishEvent):
        choice.finish_reason = FINISH_REASONS[event.reason]
        choice.prompt_tokens, choice.completion_tokens = (event.prompt_tokens,
                                                          event.completion_tokens)
    choice.text += event.text
    return event.text


@dataclass(frozen=True)
class Reply:
    """What every response and chunk of one request carries."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, request_id: str, model: str) -> Reply:
        return cls(f"{prefix}-{request_id}", model, int(time.time()))

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
                          choices=[{"index": i, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": None, "finish_reason": c.finish_reason}
                                   for i, c in enumerate(choices)],
                          usage=usage(choices, n))

    @staticmethod
    def opening(reply: Reply, index: int) -> dict:
        """The first chunk of a choice: its role, as OpenAI sends it."""
        return ChatFormat._chunk(reply, index, {"role": "assistant", "content": ""}, None)

    @staticmethod
    def chunk(reply: Reply, index: int, text: str, finish_reason: str | None) -> dict:
        delta = {} if finish_reason is not None and not text else {"content": text}
        return ChatFormat._chunk(reply, index, delta, finish_reason)

    @staticmethod
    def _chunk(reply: Reply, index: int, delta: dict, finish_reason: str | None) -> dict:
        return reply.body("chat.completion.chunk",
                          choices=[{"index": index, "delta": delta, "logprobs": None,
                                    "finish_reason": finish_reason}])

    @staticmethod
    def usage_chunk(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("chat.completion.chunk", choices=[], usage=usage(choices, n))


class CompletionFormat:
    """text_completion bodies and stream events."""

    id_prefix = "cmpl"

    @staticmethod
    def response(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("text_completion",
                          choices=[{"index": i, "text": c.text, "logprobs": None,
                                    "finish_reason": c.finish_reason}
                                   for i, c in enumerate(choices)],
                          usage=usage(choices, n))

    @staticmethod
    def opening(reply: Reply, index: int) -> dict | None:
        return None

    @staticmethod
    def chunk(reply: Reply, index: int, text: str, finish_reason: str | None) -> dict:
        return reply.body("text_completion",
                          choices=[{"index": index, "text": text, "logprobs": None,
                                    "finish_reason": finish_reason}])

    @staticmethod
    def usage_chunk(reply: Reply, choices: list[Choice], n: int) -> dict:
        return reply.body("text_completion", choices=[], usage=usage(choices, n))
