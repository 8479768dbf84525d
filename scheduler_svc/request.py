"""What a client asked for, in plain Python (no protobuf), and its validation against the model:
`check_sizes` first, in bounded time; `prepare`, whose cost grows with the request, off the loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from scheduler_svc.errors import InvalidArgument
from scheduler_svc.sampling_params import (GenerationDefaults, SamplingParams, StoppingParams,
                                           TokenLogprobs, shown_ids)
from scheduler_svc.sequence import FinishReason
from scheduler_svc.stop_strings import StopStringMatcher

MAX_REQUEST_ID_CHARS = 256
MAX_N = 16  # samples of one request (parallel sampling)


@dataclass(frozen=True)
class RequestLimits:
    """Size limits of one request, checked before any work proportional to the request."""

    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of text, or of all chat roles and contents
    max_chat_messages: int = 1024
    # A structured output's grammar must compile with the model's tokenizer within this (at
    # admission, on a grammar thread): far above a typical schema's compile (RESULTS.md).
    grammar_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_prompt_bytes < 1 or self.max_chat_messages < 1:
            raise ValueError(f"request limits must be >= 1: {self}")
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s must be > 0: {self}")


@dataclass(frozen=True)
class ModelLimits:
    """What the attached executor's model allows (from Describe)."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int | None  # the tokenizer's
    # The generation config's other EOS ids: stop tokens of every request that does not ignore
    # EOS (vLLM adds them to stop_token_ids).
    eos_stop_token_ids: tuple[int, ...] = ()
    defaults: GenerationDefaults = GenerationDefaults()  # for a request's unset fields


@dataclass(frozen=True)
class GenerateSpec:
    """One Generate request. Exactly one of prompt_text, prompt_token_ids, chat is set."""

    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    chat: list[dict[str, str]] | None = None
    tools: list[dict] | None = None  # OpenAI's tools, which the chat template is given
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    request_id: str = ""
    n: int = 1  # samples of the prompt (parallel sampling)
    # time.monotonic() past which the client gives up (gRPC deadline, OpenAI SDK read timeout)
    deadline: float | None = None
    # Which of sampling_params.DEFAULTABLE_FIELDS the client left unset: the model's generation
    # defaults replace the API's own there (ModelLimits.defaults).
    unset: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to queue: its prompt ids, its parameters with the model's defaults and
    EOS ids applied, and a stop-string matcher per sample (None: no stop strings); matchers hold
    state, so each sample has its own."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    stoppers: tuple[StopStringMatcher | None, ...] = (None,)


@dataclass(slots=True)
class TokenEvent:
    """One generated token and the text it completed (possibly empty). Not frozen: the step loop
    makes one per token per stream, and a frozen dataclass's __init__ (object.__setattr__ per
    field) costs several times a plain one's; nothing changes an event once made."""

    token_id: int
    text: str
    index: int
    logprobs: TokenLogprobs | None = None  # when the request's sampling.logprobs was set
    sample_index: int = 0  # which of the request's n samples


@dataclass(frozen=True)
class FinishEvent:
    """The end of a request's stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # text held back until the end (e.g. a partial stop-string prefix)
    sample_index: int = 0  # which of the request's n samples


def check_request_id(request_id: str) -> None:
    """Request ids are echoed in every response and written to logs: short and printable."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, "
                              f"got {len(request_id)}")
    if not request_id.isprintable():
        raise InvalidArgument("request_id", "must be printable (no control characters)")


def check_sizes(spec: GenerateSpec, limits: RequestLimits) -> None:
    """Rejects a prompt over the byte limits, or one that is not Unicode (a lone surrogate: no
    tokenizer takes one); O(1) per chat message, O(prompt) only in C."""
    if spec.chat is not None:
        if len(spec.chat) > limits.max_chat_messages:
            raise InvalidArgument("prompt.chat.messages", f"at most {limits.max_chat_messages} "
                                  f"messages, got {len(spec.chat)}")
        num_bytes = sum(_utf8_len(m[key], limits, f"prompt.chat.messages[{i}].{key}")
                        for i, m in enumerate(spec.chat) for key in ("role", "content"))
        field_name = "prompt.chat"
    else:
        field_name = "prompt.text"
        num_bytes = _utf8_len(spec.prompt_text or "", limits, field_name)
    if num_bytes > limits.max_prompt_bytes:
        raise InvalidArgument(field_name, f"at most {limits.max_prompt_bytes} bytes, got "
                              f"{num_bytes if num_bytes <= 2 * limits.max_prompt_bytes else 'more'}")


def _utf8_len(text: str, limits: RequestLimits, field_name: str) -> int:
    # a str has at least one byte per character: longer ones are refused without encoding them
    if len(text) > limits.max_prompt_bytes:
        return len(text) * 2 + 1
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(field_name, "is not valid Unicode (a lone surrogate)") from None


def prepare(spec: GenerateSpec, tokenizer, limits: ModelLimits) -> PreparedRequest:
    """Everything about a request whose cost grows with its size; raises InvalidArgument."""
    sampling, stopping = limits.defaults.apply(spec.sampling, spec.stopping, spec.unset)
    if sampling is not spec.sampling or stopping is not spec.stopping:
        spec = replace(spec, sampling=sampling, stopping=stopping)
    validate_params(spec, limits)
    if spec.stopping.stop and tokenizer is None:
        raise InvalidArgument("stop", "this model has no tokenizer; use stop_token_ids")
    prompt_ids = resolve_prompt(spec, tokenizer, limits)
    stoppers = tuple(StopStringMatcher(spec.stopping.stop) if spec.stopping.stop else None
                     for _ in range(spec.n))
    return PreparedRequest(prompt_ids, spec.sampling, with_model_eos(spec.stopping, limits),
                           stoppers)


def with_model_eos(stopping: StoppingParams, limits: ModelLimits) -> StoppingParams:
    """`stopping` with the model's other EOS ids among its stop ids, unless it ignores EOS
    (vLLM's SamplingParams.update_from_generation_config); after validation, so that they do not
    count against the request's own limit."""
    extra = [i for i in limits.eos_stop_token_ids if i not in stopping.stop_token_ids]
    if stopping.ignore_eos or not extra:
        return stopping
    return replace(stopping, stop_token_ids=(*stopping.stop_token_ids, *extra))


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
        # here, not at the top: what imports this module without a tokenizer skips transformers
        from scheduler_svc.tokenizer import ChatTemplateError

        try:
            return tokenizer.apply_chat_template(spec.chat, spec.tools)
        except ChatTemplateError as err:
            raise InvalidArgument(field_name, f"the model's chat template refused the "
                                  f"messages: {err}") from None
    if not spec.prompt_text:
        raise InvalidArgument(field_name, "must not be empty")
    return tokenizer.encode(spec.prompt_text)


def _check_prompt_ids(ids: list[int], field_name: str, limits: ModelLimits) -> None:
    if not ids:
        raise InvalidArgument(field_name, "must not be empty")
    if len(ids) >= limits.max_model_len:  # before the scan below, which is O(len)
        raise InvalidArgument(
            field_name,
            f"prompt has {len(ids)} tokens; the model allows at most "
            f"{limits.max_model_len - 1} so that one token can be generated")
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise InvalidArgument(
            field_name, f"{len(bad)} ids out of vocabulary (vocab_size {limits.vocab_size}), "
            f"first {shown_ids(bad)}")


def validate_params(spec: GenerateSpec, limits: ModelLimits) -> None:
    """Range checks of n and of the sampling and stopping parameters."""
    if not 1 <= spec.n <= MAX_N:
        raise InvalidArgument("n", f"must be in [1, {MAX_N}], got {spec.n}")
    spec.sampling.validate(limits.vocab_size)
    spec.stopping.validate(limits.vocab_size)
