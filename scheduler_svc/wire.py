"""Conversions between protobuf messages and scheduler_svc's plain-Python types.

The only scheduler module besides the servicers and the executor client that touches generated code.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve_common.executor_identity import ExecutorIdentity, identity_fields
from protos import executor_pb2, generate_pb2
from scheduler_svc.plan import CachedSeqs, NewSeqPlan, StepPlan, StepResult
from scheduler_svc.errors import ExecutorDisagreement, InvalidArgument
from scheduler_svc.request import (FinishEvent, GenerateSpec, RequestLimits, TokenEvent,
                                   check_request_id)
from scheduler_svc.sampling_params import (DEFAULTABLE_SAMPLING_FIELDS, GenerationDefaults,
                                           SamplingParams, StoppingParams, TokenLogprobs)
from scheduler_svc.sequence import FinishReason
from scheduler_svc.step_limits import StepLimits
from scheduler_svc.structured_output import StructuredOutput, structured_output

_FINISH_REASONS = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.STOP_TOKEN: generate_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: generate_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.ABORTED: generate_pb2.FINISH_REASON_ABORTED,
}


# The executor protocol this build speaks: an executor that names another is refused.
PROTOCOL_VERSION = executor_pb2.PROTOCOL_VERSION


@dataclass(frozen=True)
class ExecutorDescription(ExecutorIdentity):
    """Describe's answer, in plain Python."""

    instance_id: int
    protocol_version: int = PROTOCOL_VERSION  # what Describe named; 0: none
    eos_token_ids: tuple[int, ...] = ()  # every EOS id of the model's generation config
    generation_defaults: GenerationDefaults = GenerationDefaults()
    step_limits: StepLimits | None = None  # None: the executor recommends none
    quantization: str = ""  # the checkpoint's, e.g. "awq int4 g128"; "": dense weights
    kv_cache_dtype: str = ""  # the KV cache's element type, e.g. "fp8_e4m3"


# --- public API ---------------------------------------------------------------------------------

def spec_from_proto(req: generate_pb2.GenerateRequest, request_id: str,
                    limits: RequestLimits) -> GenerateSpec:
    """The request as a GenerateSpec; range checks happen later, against the model. The number of
    chat messages is checked before they are converted, request_id before anything."""
    check_request_id(req.request_id)
    which = req.WhichOneof("prompt")
    if which == "chat" and len(req.chat.messages) > limits.max_chat_messages:
        raise InvalidArgument("prompt.chat.messages", f"at most {limits.max_chat_messages} "
                              f"messages, got {len(req.chat.messages)}")
    s, st = req.sampling, req.stopping
    sampling = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.top_k != 0 else -1,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty") else 1.0),
        logit_bias=tuple(sorted(s.logit_bias.items())),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        structured=_structured_from_proto(req),
    )
    stopping = StoppingParams(
        max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
        min_tokens=st.min_tokens,
        stop=tuple(st.stop),
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
    )
    return GenerateSpec(
        prompt_text=req.text if which == "text" else None,
        prompt_token_ids=list(req.token_ids.ids) if which == "token_ids" else None,
        chat=[{"role": m.role, "content": m.content} for m in req.chat.messages]
        if which == "chat" else None,
        sampling=sampling,
        stopping=stopping,
        request_id=request_id,
        n=req.n if req.HasField("n") and req.n else 1,
        unset=_unset_fields(s, st),
    )


def _structured_from_proto(req: generate_pb2.GenerateRequest) -> StructuredOutput | None:
    """The request's output format (its size and syntax checked here, its compile at
    admission); None when unset."""
    if not req.HasField("structured_output"):
        return None
    so = req.structured_output
    kind = so.WhichOneof("format")
    if kind is None:
        raise InvalidArgument("structured_output", "set exactly one format, or leave it unset")
    field = f"structured_output.{kind}"
    if kind == "json_object":
        if not so.json_object:
            raise InvalidArgument(field, "must be true when set")
        return structured_output("json_object", None, field)
    if kind == "choice":
        return structured_output("choice", list(so.choice.choices), field)
    return structured_output("json" if kind == "json_schema" else kind, getattr(so, kind), field)


def _unset_fields(s: generate_pb2.SamplingParams, st: generate_pb2.StoppingCriteria
                  ) -> frozenset[str]:
    """The defaultable fields the request does not set (field presence; 0 set is set)."""
    unset = {name for name in DEFAULTABLE_SAMPLING_FIELDS if not s.HasField(name)}
    if not st.HasField("max_tokens"):
        unset.add("max_tokens")
    return frozenset(unset)


def events_to_protos(events: list[TokenEvent | FinishEvent], request_id: str
                     ) -> list[generate_pb2.GenerateResponse]:
    """The messages for a batch of one request's events: each sample's consecutive tokens as one
    message (before that sample's final message, if the batch has it), in order of appearance."""
    if len(events) == 1:  # one token, one message: the usual batch, made in one call
        event = events[0]
        if type(event) is TokenEvent and event.logprobs is None:
            return [generate_pb2.GenerateResponse(
                token_ids=(event.token_id,), text=event.text, index=event.index,
                request_id=request_id, sample_index=event.sample_index)]
    out: list[generate_pb2.GenerateResponse] = []
    open_msgs: dict[int, generate_pb2.GenerateResponse] = {}  # sample -> its tokens so far
    for event in events:
        if isinstance(event, FinishEvent):
            open_msgs.pop(event.sample_index, None)
            out.append(finish_to_proto(event, request_id))
            continue
        msg = open_msgs.get(event.sample_index)
        if msg is None:
            msg = open_msgs[event.sample_index] = generate_pb2.GenerateResponse(
                index=event.index, request_id=request_id, sample_index=event.sample_index)
            out.append(msg)
        msg.token_ids.append(event.token_id)
        msg.text += event.text
        if event.logprobs is not None:
            entry = msg.logprobs.add(logprob=event.logprobs.logprob)
            entry.top.extend(generate_pb2.TokenLogprob(token_id=t, logprob=lp)
                             for t, lp in event.logprobs.top)
    return out


def finish_to_proto(event: FinishEvent, request_id: str) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(
        text=event.text,
        finished=True,
        finish_reason=_FINISH_REASONS[event.reason],
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        request_id=request_id,
        sample_index=event.sample_index,
    )


# --- executor protocol --------------------------------------------------------------------------

def _pairs(pairs: list[tuple[int, int]]) -> list[executor_pb2.BlockPair]:
    return [executor_pb2.BlockPair(src=src, dst=dst) for src, dst in pairs]


def plan_to_proto(plan: StepPlan) -> executor_pb2.StepPlan:
    """The plan's message; raises ValueError or TypeError when a field does not fit its wire type
    (`unencodable_seq_ids` then says which new seqs are the cause)."""
    msg = executor_pb2.StepPlan(
        step_id=plan.step_id,
        swap_out=_pairs(plan.swap_out),
        swap_in=_pairs(plan.swap_in),
        copy=_pairs(plan.copy),
        new_seqs=[_new_seq(s) for s in plan.new_seqs],
        finished_seq_ids=plan.finished_seq_ids,
        preempted_seq_ids=plan.preempted_seq_ids,
    )
    _fill_cached_seqs(plan.cached_seqs, msg.cached)
    return msg


def unencodable_seq_ids(plan: StepPlan) -> list[int]:
    """The new seqs of `plan` whose own message cannot be encoded (a value out of its wire type's
    range): a failure those explain is theirs alone."""
    bad = []
    for s in plan.new_seqs:
        try:
            _new_seq(s)
        except (ValueError, TypeError, OverflowError):
            bad.append(s.seq_id)
    return bad


def _new_seq(s: NewSeqPlan) -> executor_pb2.NewSeq:
    first = first_position(s)
    return executor_pb2.NewSeq(
        seq_id=s.seq_id,
        token_ids=s.token_ids[first:] if first else s.token_ids,
        block_table=s.block_table,
        num_computed_tokens=s.num_computed_tokens,
        num_scheduled_tokens=s.num_scheduled_tokens,
        sampling=_sampling_options(s.sampling, s.seed),
        num_prompt_tokens=s.num_prompt_tokens or 0,
        first_position=first,
    )


def first_position(s: NewSeqPlan) -> int:
    """Where a new seq's tokens on the wire start: past its computed ones (a cached prefix's:
    the KV cache holds them and the executor never reads them), unless a penalty counts every
    token, or a grammar replays the generated ones (then at the prompt's end at the latest). A
    chat turn over a 2,000-token conversation then sends its new tokens, not 2,000 ids encoded,
    sent and parsed again."""
    if s.sampling.uses_penalties:
        return 0
    if s.sampling.structured is not None:  # the executor replays the generated tokens
        return min(s.num_computed_tokens, s.num_prompt_tokens or 0)
    return s.num_computed_tokens


def _sampling_options(p: SamplingParams, seed: int) -> executor_pb2.SamplingOptions:
    msg = executor_pb2.SamplingOptions(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=seed,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias_token_ids=[t for t, _ in p.logit_bias],
        logit_bias_values=[b for _, b in p.logit_bias])
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.structured is not None:
        msg.grammar = p.structured.grammar
    return msg


def _fill_cached_seqs(cached: CachedSeqs, out: executor_pb2.CachedSeqs) -> None:
    """Column for column, each list extended into the field in place: a CachedSeqs built
    apart and passed to StepPlan(cached=...) would be copied once more (+30% at 1,024 seqs)."""
    if not cached:  # leaves `cached` unset rather than empty
        return
    out.seq_ids.extend(cached.seq_ids)
    out.num_scheduled_tokens.extend(cached.num_scheduled_tokens)
    out.num_computed_tokens.extend(cached.num_computed_tokens)
    out.num_new_blocks.extend(cached.num_new_blocks)
    out.new_block_ids.extend(cached.new_block_ids)


# Trailing metadata of an Execute stream that failed because of some seqs' own content (a token
# id or a sampling option the executor refuses): their ids, comma-separated. executor_svc.wire
# writes it under the same key.
BAD_SEQ_IDS_KEY = "pagedserve-bad-seq-ids"
_MAX_BAD_SEQ_IDS = 1024


def bad_seq_ids(metadata) -> tuple[int, ...]:
    """The seq ids that a failed stream's trailing metadata names; () if none or unreadable."""
    for key, value in metadata or ():
        if key == BAD_SEQ_IDS_KEY and isinstance(value, str):
            try:
                return tuple(int(v) for v in value.split(",", _MAX_BAD_SEQ_IDS)[:_MAX_BAD_SEQ_IDS])
            except ValueError:
                return ()
    return ()


def result_from_proto(result: executor_pb2.StepResult) -> StepResult:
    """The result in plain Python; ExecutorDisagreement if its columns do not line up."""
    sampled = result.sampled
    tokens = dict(zip(sampled.seq_ids, sampled.token_ids))
    if not len(tokens) == len(sampled.seq_ids) == len(sampled.token_ids):
        raise ExecutorDisagreement(f"sampled: {len(sampled.seq_ids)} seq ids, "
                                   f"{len(tokens)} of them distinct, {len(sampled.token_ids)} "
                                   "token ids")
    logprobs = _logprobs(result.logprobs) if result.HasField("logprobs") else {}
    return StepResult(tokens, result.forward_ms, result.step_ms, logprobs)


def _logprobs(columns: executor_pb2.SampledLogprobs) -> dict[int, TokenLogprobs]:
    seq_ids, num_top = columns.seq_ids, columns.num_top_logprobs
    top = list(zip(columns.top_token_ids, columns.top_logprobs))
    if not (len(seq_ids) == len(columns.logprobs) == len(num_top)
            and sum(num_top) == len(top) == len(columns.top_token_ids)
            == len(columns.top_logprobs)):
        raise ExecutorDisagreement("logprobs: columns of different lengths, or "
                                   "num_top_logprobs does not add up to the top ones")
    out, start = {}, 0
    for seq_id, logprob, k in zip(seq_ids, columns.logprobs, num_top):
        out[seq_id] = TokenLogprobs(logprob, tuple(top[start:start + k]))
        start += k
    return out


def description_from_proto(d: executor_pb2.DescribeResponse) -> ExecutorDescription:
    return ExecutorDescription(
        **identity_fields(d),
        instance_id=d.instance_id,
        protocol_version=d.protocol_version,
        eos_token_ids=tuple(d.generation_config.eos_token_ids),
        generation_defaults=_generation_defaults(d.generation_config),
        step_limits=_step_limits(d.step_limits) if d.HasField("step_limits") else None,
        quantization=d.quantization,
        # an executor built before the field sends none: its cache holds the model's dtype
        kv_cache_dtype=d.kv_cache_dtype or d.dtype,
    )


def _step_limits(s: executor_pb2.StepLimits) -> StepLimits:
    """As sent (range checks are the attach's)."""
    return StepLimits(s.max_num_batched_tokens, s.max_num_seqs, s.bounded, s.source,
                      tuple(s.decode_graph_sizes), tuple(s.small_step_graph_sizes))


def _generation_defaults(g: executor_pb2.GenerationConfig) -> GenerationDefaults:
    """The defaults the executor's model sets (range checks are the attach's)."""
    values = {name: getattr(g, name) for name in DEFAULTABLE_SAMPLING_FIELDS if g.HasField(name)}
    if g.HasField("max_new_tokens"):
        values["max_tokens"] = g.max_new_tokens
    return GenerationDefaults(**values)
