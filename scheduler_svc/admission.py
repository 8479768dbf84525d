"""Admission: whether requests are taken now, whether the waiting queue (at the rate it drains)
has room for one before its deadline, and the sequences a request becomes, prepared with the
attached model's tokenizer and limits. Plain asyncio; never imports the engine or gRPC."""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.request import GenerateSpec, ModelLimits, PreparedRequest, prepare
from scheduler_svc.sampling_params import GenerationDefaults
from scheduler_svc.sequence import Sequence
from scheduler_svc.structured_output import GrammarChecker, StructuredOutput
from scheduler_svc.tokenizer import load_tokenizer

# Retry hints stay within what clients honour (the OpenAI SDKs follow Retry-After up to 60 s).
MIN_RETRY_S, MAX_RETRY_S = 1, 60
# A prompt of token ids up to this long, without stop strings, is prepared on the event loop:
# its checks cost less there than the hand-over to a prepare thread and back. Text, chat and
# stop strings, whose cost grows much faster with the request, go to a prepare thread.
INLINE_PREPARE_MAX_IDS = 8192

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue has no room for the request's sequences, or would keep it from starting
    before its deadline; mapped to RESOURCE_EXHAUSTED (HTTP 429), with a hint of when to retry."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(f"{message}; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s


class NoExecutor(Exception):
    """No executor has been reachable for longer than the grace period; mapped to UNAVAILABLE."""


class ShuttingDown(Exception):
    """The service is draining before it stops; mapped to UNAVAILABLE."""


def retry_hint_s(seconds: float | None) -> int:
    """A whole number of seconds to suggest before a retry (Retry-After, and gRPC's pushback)."""
    if seconds is None or not math.isfinite(seconds):
        return MIN_RETRY_S if seconds is None else MAX_RETRY_S
    return min(max(math.ceil(seconds), MIN_RETRY_S), MAX_RETRY_S)


def can_prepare_inline(spec: GenerateSpec) -> bool:
    """Whether preparing `spec` is cheap and bounded enough to run on the event loop."""
    ids = spec.prompt_token_ids
    return ids is not None and len(ids) <= INLINE_PREPARE_MAX_IDS and not spec.stopping.stop


def check_fits(seq: Sequence, can_ever_fit: Callable[[int], bool]) -> None:
    """The one check that a request fits the KV cache: an explicit max_tokens must fit in
    the whole cache; without one, the cache's size caps the output (finish reason LENGTH)."""
    if seq.stopping.max_tokens is None:
        needed, what = seq.num_prompt_tokens + 1, "prompt"
    else:
        needed, what = seq.num_prompt_tokens + seq.max_tokens, "max_tokens"
    if not can_ever_fit(needed):
        raise InvalidArgument(
            what, f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens "
            f"({seq.max_tokens}) can never fit in the KV cache")


class Admission:
    """Open while an executor is attached, or for the grace period after none is; closed while
    draining or once every executor refuses this scheduler. The engine reports attachment here;
    `why` callables give its reason for a refusal's message."""

    def __init__(self, config: EngineConfig) -> None:
        self.max_waiting = config.max_waiting
        self.grace_s = config.unavailable_grace_s
        self.draining = False
        self.refusal: str | None = None  # why every executor refused this scheduler
        self.refused = asyncio.Event()
        self.ready = asyncio.Event()  # set while a scheduler (and so a tokenizer) exists
        self.detached_since: float | None = time.monotonic()
        self.tokenizer = None  # the attached model's (None: it has none), and its limits
        self.limits: ModelLimits | None = None
        self._tokenizer_source: str | None = None
        self.grammar_timeout_s = config.limits.grammar_timeout_s
        self.grammars: GrammarChecker | None = None  # of the tokenizer and vocabulary in use
        self._grammars_for: tuple | None = None
        self.use_generation_config = config.generation_config == "auto"
        self._logged_generation_config = None  # what the log last said of the model's config
        self._prepare_pool = ThreadPoolExecutor(config.num_prepare_threads,
                                                thread_name_prefix="prepare")
        self._seq_ids = itertools.count(1)

    async def load_model(self, description) -> None:
        """The tokenizer (loaded again only when its source changes) and limits Describe gives."""
        if description.tokenizer != self._tokenizer_source:
            try:
                self.tokenizer = await asyncio.to_thread(load_tokenizer, description.tokenizer)
            except Exception as err:  # noqa: BLE001 - any reason a tokenizer will not load
                raise RuntimeError(f"the tokenizer at {description.tokenizer!r} did not load: "
                                   f"{type(err).__name__}: {err}") from err
            self._tokenizer_source = description.tokenizer
        self._load_grammars(description.vocab_size)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        defaults = description.generation_defaults
        if not self.use_generation_config:
            defaults = GenerationDefaults()
        try:
            defaults.validate(description.vocab_size)
        except InvalidArgument as err:
            raise RuntimeError(f"the model's generation config has a default no request may "
                               f"have ({err}); fix it or run --generation-config vllm") from None
        others = tuple(i for i in description.eos_token_ids if i != eos)
        self.limits = ModelLimits(description.vocab_size, description.max_model_len, eos,
                                  others, defaults)
        self._log_generation_config(description.generation_defaults, others)

    def _log_generation_config(self, defaults: GenerationDefaults, others: tuple[int, ...]
                               ) -> None:
        """Once per model: the defaults that apply (in vLLM's words) and the EOS ids that stop
        requests beside the tokenizer's."""
        said = (defaults, others, self.use_generation_config)
        if said == self._logged_generation_config:
            return
        self._logged_generation_config = said
        if defaults.items() and self.use_generation_config:
            log.warning("Default sampling parameters have been overridden by the model's Hugging "
                        "Face generation config recommended from the model creator. If this is "
                        "not intended, please relaunch with `--generation-config vllm`.")
            log.info("Using default sampling params from model (gRPC and OpenAI APIs): %s",
                     defaults.items())
        elif defaults.items():
            log.info("the model's generation config defaults are not applied "
                     "(--generation-config vllm): %s", defaults.items())
        if others:
            log.info("the model's generation config adds EOS ids %s: they stop requests as stop "
                     "tokens unless ignore_eos", list(others))

    def on_attached(self) -> None:
        self.detached_since, self.refusal = None, None
        self.refused.clear()
        self.ready.set()

    def on_detached(self) -> None:
        self.detached_since = time.monotonic()
        self.ready.clear()

    def on_refused(self, reason: str) -> None:
        """Requests fail now rather than wait for a lease that may never come back."""
        self.refusal = reason
        self.refused.set()

    def _load_grammars(self, vocab_size: int) -> None:
        """The grammar checker of this tokenizer and vocabulary (its tokenizer builds on a
        thread)."""
        key = (self._tokenizer_source, vocab_size)
        if key == self._grammars_for:
            return
        if self.grammars is not None:
            self.grammars.close()
        self.grammars = (None if self.tokenizer is None else GrammarChecker(
            self.tokenizer.hf_tokenizer, vocab_size, self.grammar_timeout_s))
        self._grammars_for = key

    def close(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()

    def check_open(self, lost_since: float | None, why: Callable[[], str]) -> None:
        """Raises ShuttingDown or NoExecutor; `lost_since`: when the attached link was lost."""
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if self.refusal is not None:
            raise NoExecutor(f"no executor takes this scheduler: {self.refusal}")
        if self.detached_since is not None:
            if time.monotonic() - self.detached_since < self.grace_s:
                return
            raise NoExecutor(f"no executor attached for "
                             f"{time.monotonic() - self.detached_since:.0f}s{why()}")
        if lost_since is not None and time.monotonic() - lost_since > self.grace_s:
            raise NoExecutor(f"no executor reachable for {time.monotonic() - lost_since:.0f}s"
                             f"{why()}")

    def check(self, spec: GenerateSpec, scheduler, lost_since: float | None,
              why: Callable[[], str]) -> None:
        """check_open, then NoExecutor while detached, then check_room against `scheduler`'s
        waiting queue."""
        self.check_open(lost_since, why)
        if scheduler is None:
            raise NoExecutor(f"the executor was detached{why()}")
        self.check_room(spec, scheduler.num_waiting, scheduler.drain_rate())

    def check_room(self, spec: GenerateSpec, num_waiting: int, rate: float | None) -> None:
        """QueueFull if the request's n sequences would take the waiting ones past --max-waiting
        (unless none wait), or its deadline ends before those ahead can start at `rate`."""
        over = num_waiting + spec.n - self.max_waiting
        if over > 0 and num_waiting:
            raise QueueFull(f"{num_waiting} sequences are waiting and this request adds {spec.n}: "
                            f"over --max-waiting ({self.max_waiting})",
                            retry_hint_s(over / rate if rate else None))
        if spec.deadline is None or not num_waiting or rate is None:
            return
        left, wait = spec.deadline - time.monotonic(), num_waiting / rate
        if wait > left:
            raise QueueFull(f"{num_waiting} sequences wait ahead of this request, starting at "
                            f"about {rate:.3g}/s: it would not start within its deadline "
                            f"({max(left, 0):.1f}s left)", retry_hint_s(wait - max(left, 0)))

    async def wait_attached(self) -> None:
        """Until an executor attaches, every executor refuses this scheduler, or the grace ends."""
        left = self.grace_s - (time.monotonic() - self.detached_since)
        if left <= 0:
            return
        ready = asyncio.ensure_future(self.ready.wait())
        refused = asyncio.ensure_future(self.refused.wait())
        try:
            await asyncio.wait({ready, refused}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            refused.cancel()

    async def outage_error(self, lost_since: float, why: Callable[[], str]) -> NoExecutor:
        """Waits until every executor refuses this scheduler or the outage that began at
        `lost_since` outlasts the grace; the error that then ends the open requests."""
        left = self.grace_s - (time.monotonic() - lost_since)
        try:
            await asyncio.wait_for(self.refused.wait(), max(left, 0))
            return NoExecutor(f"no executor takes this scheduler: {self.refusal}")
        except asyncio.TimeoutError:
            return NoExecutor(f"no executor reachable for {self.grace_s:g}s{why()}")

    async def prepare(self, spec: GenerateSpec) -> PreparedRequest:
        """Tokenizes and validates `spec`: on the event loop when cheap, else on a thread."""
        if can_prepare_inline(spec):
            prepared = prepare(spec, self.tokenizer, self.limits)
        else:
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, prepare, spec, self.tokenizer, self.limits)
        if prepared.sampling.structured is not None:
            await self._check_grammar(prepared.sampling.structured)
        return prepared

    async def _check_grammar(self, structured: StructuredOutput) -> None:
        """InvalidArgument naming the field unless the grammar compiles within the limit."""
        if self.grammars is None:
            raise InvalidArgument(structured.field, "this model has no tokenizer: structured "
                                  "output needs one")
        await self.grammars.check(structured)

    def new_seqs(self, spec: GenerateSpec, prepared: PreparedRequest) -> list[Sequence]:
        """A seq per sample; with a seed, sample i uses seed + i (as the OpenAI API's n did with
        n requests, and vLLM with its parallel samples): distinct and reproducible."""
        seqs: list[Sequence] = []
        limits = self.limits
        for _ in range(spec.n):  # one arrival time: the samples are one request, in age order
            seqs.append(Sequence(next(self._seq_ids), prepared.prompt_token_ids,
                                 prepared.sampling, prepared.stopping, limits.eos_token_id,
                                 limits.max_model_len, seqs[0].arrival_time if seqs else None))
        if spec.sampling.seed is not None:
            for i, seq in enumerate(seqs):
                seq.seed = (spec.sampling.seed + i) % 2**64
        return seqs
