"""What a client asked for, in plain Python (no protobuf), and its validation against the model.

`GenerateSpec` is built by the wire module from the public request; `resolve_prompt` turns it
into prompt token ids or raises InvalidArgument naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.errors import InvalidArgument
from scheduler_svc.sampling_params import SamplingParams, StoppingParams
from scheduler_svc.sequence import FinishReason


@dataclass(frozen=True)
class ModelLimits:
    """What the attached executor's model allows (from Describe)."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None


@dataclass(frozen=True)
class GenerateSpec:
    """One Generate request. Exactly one of prompt_text, prompt_token_ids, chat is set."""

    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    chat: list[dict[str, str]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    request_id: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completed (possibly empty)."""

    token_id: int
    text: str
    index: int


@dataclass(frozen=True)
class FinishEvent:
    """The end of a request's stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # text held back until the end (e.g. a partial stop-string prefix)


def resolve_prompt(spec: GenerateSpec, tokenizer, limits: ModelLimits) -> list[int]:
    """Prompt token ids for `spec`, validated; raises InvalidArgument naming the field."""
    if spec.prompt_token_ids is not None:
        ids = list(spec.prompt_token_ids)
        field_name = "prompt.token_ids"
    elif spec.prompt_text is not None or spec.chat is not None:
        field_name = "prompt.text" if spec.prompt_text is not None else "prompt.chat"
        if tokenizer is None:
            raise InvalidArgument(field_name, "this model has no tokenizer; send prompt.token_ids")
        ids = _tokenize(spec, tokenizer, field_name)
    else:
        raise InvalidArgument("prompt", "one of text, token_ids or chat is required")
    _check_prompt_ids(ids, field_name, limits)
    return ids


def _tokenize(spec: GenerateSpec, tokenizer, field_name: str) -> list[int]:
    if spec.chat is not None:
        if not spec.chat:
            raise InvalidArgument(field_name, "must not be empty")
        for i, message in enumerate(spec.chat):
            if not message["role"]:
                raise InvalidArgument(f"prompt.chat.messages[{i}].role", "must not be empty")
        if not tokenizer.has_chat_template:
            raise InvalidArgument(field_name, "this model's tokenizer has no chat template")
        return tokenizer.apply_chat_template(spec.chat)
    if not spec.prompt_text:
        raise InvalidArgument(field_name, "must not be empty")
    return tokenizer.encode(spec.prompt_text)


def _check_prompt_ids(ids: list[int], field_name: str, limits: ModelLimits) -> None:
    if not ids:
        raise InvalidArgument(field_name, "must not be empty")
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise InvalidArgument(
            field_name, f"ids {bad[:8]} out of vocabulary (vocab_size {limits.vocab_size})")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgument(
            field_name,
            f"prompt has {len(ids)} tokens; the model allows at most "
            f"{limits.max_model_len - 1} so that one token can be generated")


def validate_params(spec: GenerateSpec, limits: ModelLimits) -> None:
    """Range checks of the sampling and stopping parameters."""
    spec.sampling.validate()
    spec.stopping.validate(limits.vocab_size)
