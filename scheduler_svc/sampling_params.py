"""Per-request sampling and stopping parameters, with validation that names the bad field, costs
O(size limit) at most and quotes a few items, never a whole list. No torch, no protobuf.
"""

import math
import struct
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from scheduler_svc.errors import InvalidArgument

if TYPE_CHECKING:
    from scheduler_svc.structured_output import StructuredOutput

# Stop strings are delimiters ("\n\n", "</tool_call>", a chat template's end marker). OpenAI allows
# 4 and TGI 4 by default; 64 leaves room for any template. Matching costs the same per character
# whatever their number (stop_strings.py), but its set-up and memory grow with the total length,
# which these bound (once per request).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024  # Unicode code points, as len() counts them
# The scheduler tests every sampled token against them; ~1,000 covers "stop at any of these words".
MAX_STOP_TOKEN_IDS = 1024
_NUM_IDS_SHOWN = 8  # in an error message
# vLLM's and OpenAI's bounds: penalties in [-2, 2], biases in [-100, 100], OpenAI's 300 biased
# tokens at most, and vLLM's default max_logprobs of 20 alternatives per token.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGPROBS = 20
# The carriers' ranges: Generate's top_k is an int32 and its max_tokens, min_tokens, token ids and
# logprobs uint32, as are the executor link's; its floats are 32-bit. Both APIs refuse what either
# wire cannot carry, so one request means the same over HTTP and gRPC.
MAX_INT32 = 2**31 - 1
MAX_UINT32 = 2**32 - 1


def float32(value: float) -> float:
    """`value` as a 32-bit float carries it: rounded, inf past the float32 range."""
    try:
        return struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def shown(value: int | float) -> str:
    """A number for an error message: short however many digits a JSON client sent."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"{'-' if value < 0 else ''}a {abs(value).bit_length()}-bit integer"
    return str(value)


def shown_ids(ids) -> str:
    """The first few of `ids` for an error message, each kept short."""
    return f"[{', '.join(shown(i) for i in list(ids)[:_NUM_IDS_SHOWN])}]"


@dataclass(frozen=True)
class SamplingParams:
    """How the executor picks a token. top_k=-1 and top_p=1 and min_p=0 mean "off", as do
    penalties of 0 (presence, frequency) and 1 (repetition). The executor applies the logit bias,
    then the penalties, then temperature and the filters (vLLM's order)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # OpenAI's, on the generated tokens: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' and vLLM's, on prompt and generated tokens: a seen token's logit is divided by
    # it when positive, multiplied by it when not
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # None: no logprobs; k: each token's logprob and the k most likely tokens' (raw model
    # distribution, vLLM's default "raw_logprobs")
    logprobs: int | None = None
    # The output's format (a JSON schema, regex, choice or grammar), enforced by a token mask on
    # the executor; None: free text. Validated when built (structured_output.structured_output)
    # and compiled at admission (GrammarChecker).
    structured: "StructuredOutput | None" = None

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling counts the seq's tokens (the executor's SamplingOptions' rule)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidArgument naming the first out-of-range field; logit_bias ids must be
        < vocab_size when it is given. A top_k at or above vocab_size keeps every token (off),
        as vLLM treats it."""
        # Floats cross the executor link as 32-bit floats: a larger value would arrive as inf.
        if not (self.temperature >= 0 and math.isfinite(float32(self.temperature))):
            raise InvalidArgument("temperature", f"must be >= 0 and a finite 32-bit float, "
                                  f"got {shown(self.temperature)}")
        # 0 is off on the executor link: a top_p that rounds to it would turn the filter off
        if not (0 < self.top_p <= 1) or float32(self.top_p) == 0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {shown(self.top_p)}")
        if not -1 <= self.top_k <= MAX_INT32:
            raise InvalidArgument("top_k", f"must be -1 (off) or in [0, {MAX_INT32}], "
                                  f"got {shown(self.top_k)}")
        if not (0 <= self.min_p <= 1):
            raise InvalidArgument("min_p", f"must be in [0, 1], got {shown(self.min_p)}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidArgument("seed", f"must be in [0, 2**64), got {shown(self.seed)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
                raise InvalidArgument(name, f"must be in [-2, 2], got {shown(value)}")
        if not self.repetition_penalty > 0:
            raise InvalidArgument("repetition_penalty",
                                  f"must be > 0 (1 is off), got {shown(self.repetition_penalty)}")
        # as top_p, rounding to 0 (off) is refused; and as temperature, overflowing to inf
        if not 0 < float32(self.repetition_penalty) < math.inf:
            raise InvalidArgument("repetition_penalty", "must be > 0 and a finite 32-bit float, "
                                  f"got {shown(self.repetition_penalty)}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidArgument("logprobs",
                                  f"must be in [0, {MAX_LOGPROBS}], got {shown(self.logprobs)}")
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:  # first: what follows is O(limit)
            raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                  f"got {len(self.logit_bias)}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidArgument("logit_bias", "a token id is given twice")
        upper = MAX_UINT32 + 1 if vocab_size is None else vocab_size
        unknown = [t for t, _ in self.logit_bias if not 0 <= t < upper]
        if unknown:
            raise InvalidArgument("logit_bias", f"{len(unknown)} token ids out of vocabulary "
                                  f"(vocab_size {vocab_size}), first {shown_ids(unknown)}")
        bad = [b for _, b in self.logit_bias
               if not -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS]
        if bad:
            raise InvalidArgument("logit_bias", f"biases must be in [-100, 100], got "
                                  f"{bad[:_NUM_IDS_SHOWN]}")


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's logprob and the most likely tokens' (id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StoppingParams:
    """When a sequence stops. Stop strings are checked by the engine (detokenizer side)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field; stop ids must be < vocab_size."""
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_UINT32:
            raise InvalidArgument("max_tokens", f"must be in [1, {MAX_UINT32}], "
                                  f"got {shown(self.max_tokens)}")
        if not 0 <= self.min_tokens <= MAX_UINT32:
            raise InvalidArgument("min_tokens", f"must be in [0, {MAX_UINT32}], "
                                  f"got {shown(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgument(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {shown(self.min_tokens)}")
        self._validate_stop()
        self._validate_stop_token_ids(vocab_size)

    def _validate_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:  # first, so that what follows is O(limit)
            raise InvalidArgument(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not s:
                raise InvalidArgument("stop", "stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(
                    "stop", f"stop strings have at most {MAX_STOP_STRING_CHARS} characters, "
                    f"stop[{i}] has {len(s)}")

    def _validate_stop_token_ids(self, vocab_size: int) -> None:
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop ids, got {len(self.stop_token_ids)}")
        unknown = [t for t in self.stop_token_ids if not (0 <= t < vocab_size)]
        if unknown:
            raise InvalidArgument(
                "stop_token_ids", f"{len(unknown)} unknown stop ids (vocab_size {vocab_size}), "
                f"first {shown_ids(unknown)}")


# The request fields a model's generation config may default (vLLM's --generation-config auto:
# ModelConfig.get_diff_sampling_param, its max_new_tokens as max_tokens); the sampling ones have
# the same names in both APIs and in the executor's GenerationConfig.
DEFAULTABLE_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULTABLE_FIELDS = frozenset((*DEFAULTABLE_SAMPLING_FIELDS, "max_tokens"))


@dataclass(frozen=True)
class GenerationDefaults:
    """The attached model's defaults for the DEFAULTABLE_FIELDS a request leaves unset; None: the
    API's own default. top_k <= 0 is off, as in transformers."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def items(self) -> dict[str, float | int]:
        """The defaults set, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def apply(self, sampling: SamplingParams, stopping: StoppingParams,
              unset: frozenset[str]) -> tuple[SamplingParams, StoppingParams]:
        """`sampling` and `stopping` with the defaults of the fields in `unset`."""
        chosen = {name: value for name, value in self.items().items() if name in unset}
        if not chosen:
            return sampling, stopping
        max_tokens = chosen.pop("max_tokens", None)
        if chosen.get("top_k", 1) <= 0:
            chosen["top_k"] = -1
        if chosen:
            sampling = replace(sampling, **chosen)
        if max_tokens is not None:
            stopping = replace(stopping, max_tokens=max_tokens)
        return sampling, stopping

    def validate(self, vocab_size: int) -> None:
        """InvalidArgument naming the first default a request could not carry."""
        sampling, stopping = self.apply(SamplingParams(), StoppingParams(), DEFAULTABLE_FIELDS)
        sampling.validate(vocab_size)
        stopping.validate(vocab_size)
