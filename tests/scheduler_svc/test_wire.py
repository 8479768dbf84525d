"""The executor protocol's plan and result encodings: what the scheduler sends is what the
executor reads and back, held seqs, sampled tokens and logprobs in columns; columns that do not
line up are refused (a plan mismatch on the executor, a disagreement on the scheduler)."""

import numpy as np
import pytest

from executor_svc import wire as executor_wire
from executor_svc.step import PlanMismatch
from protos import executor_pb2, generate_pb2
from scheduler_svc import wire
from scheduler_svc.plan import CachedSeqs, NewSeqPlan, StepPlan
from scheduler_svc.errors import ExecutorDisagreement, InvalidArgument
from scheduler_svc.request import ModelLimits, RequestLimits, prepare
from scheduler_svc.sampling_params import SamplingParams


def sample_plan() -> StepPlan:
    new = NewSeqPlan(7, [5, 6, 7], [3], 0, 3, SamplingParams(temperature=0.5), seed=11)
    cached = CachedSeqs.of([(1, 1, 40, []), (2, 1, 47, [9]), (3, 16, 0, [4, 5]), (4, 1, 20, [])])
    return StepPlan(5, swap_out=[(1, 2)], copy=[(6, 8)], new_seqs=[new], cached_seqs=cached,
                    finished_seq_ids=[12], preempted_seq_ids=[13])


def test_plan_round_trip_through_the_executor_wire():
    plan = sample_plan()
    data = wire.plan_to_proto(plan).SerializeToString()
    step = executor_wire.plan_from_proto(executor_pb2.StepPlan.FromString(data))
    assert list(step.cached_seqs) == list(plan.cached_seqs) == [
        (1, 1, 40, []), (2, 1, 47, [9]), (3, 16, 0, [4, 5]), (4, 1, 20, [])]
    assert [s.seq_id for s in step.new_seqs] == [7] and step.new_seqs[0].sampling.seed == 11
    assert (step.step_id, step.swap_out, step.copy) == (5, [(1, 2)], [(6, 8)])
    assert (step.finished_seq_ids, step.preempted_seq_ids) == ([12], [13])


def test_cached_seqs_columns():
    plan = sample_plan()
    assert plan.cached_seqs.num_new_blocks == [0, 1, 2, 0]
    assert plan.cached_seqs.new_block_ids == [9, 4, 5]
    assert plan.num_scheduled_tokens == 3 + 19 and plan.num_scheduled_seqs == 5


def test_plan_without_cached_seqs_leaves_the_field_unset():
    assert not wire.plan_to_proto(StepPlan(1, finished_seq_ids=[3])).HasField("cached")


@pytest.mark.parametrize("field, values", [
    ("num_computed_tokens", [40]),  # one value short
    ("num_new_blocks", [0, 2]),  # more blocks than new_block_ids holds
])
def test_misaligned_columns_are_a_plan_mismatch(field, values):
    msg = wire.plan_to_proto(StepPlan(2, cached_seqs=CachedSeqs.of([(1, 1, 40, []),
                                                                     (2, 1, 47, [9])])))
    getattr(msg.cached, field)[:] = values
    with pytest.raises(PlanMismatch):
        executor_wire.plan_from_proto(msg)


def test_sampling_controls_cross_both_wires():
    from executor_svc.step import SampledToken, StepResult as ExecutorResult
    from protos import generate_pb2
    from scheduler_svc.request import RequestLimits, TokenEvent
    from scheduler_svc.sampling_params import TokenLogprobs
    req = generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingParams(
        presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
        logit_bias={9: -3.0, 4: 100.0}, logprobs=3))
    params = wire.spec_from_proto(req, "r", RequestLimits()).sampling
    assert params == SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25,
                                    repetition_penalty=pytest.approx(1.2),
                                    logit_bias=((4, 100.0), (9, -3.0)), logprobs=3)
    default = wire.spec_from_proto(generate_pb2.GenerateRequest(text="hi"), "r",
                                   RequestLimits()).sampling
    assert (default.repetition_penalty, default.logprobs, default.logit_bias) == (1.0, None, ())
    new = NewSeqPlan(7, [5, 6, 7, 8], [3], 0, 4, params, seed=11, num_prompt_tokens=3)
    data = wire.plan_to_proto(StepPlan(1, new_seqs=[new])).SerializeToString()
    seq = executor_wire.plan_from_proto(executor_pb2.StepPlan.FromString(data)).new_seqs[0]
    assert seq.num_prompt_tokens == 3
    o = seq.sampling
    assert (o.presence_penalty, o.frequency_penalty, o.logit_bias, o.logprobs) == (
        0.5, -0.25, ((4, 100.0), (9, -3.0)), 3)
    assert o.repetition_penalty == pytest.approx(1.2)
    result = ExecutorResult(1, np.array([7, 8], dtype=np.uint64), np.array([4, 2]), 0.0, 0.0,
                            (SampledToken(7, 4, -0.5, (4, 2), (-0.5, -1.5)),))
    data = executor_wire.result_to_proto(result).SerializeToString()
    back = wire.result_from_proto(executor_pb2.StepResult.FromString(data))
    assert back.sampled == {7: 4, 8: 2}
    assert back.logprobs == {7: TokenLogprobs(-0.5, ((4, -0.5), (2, -1.5)))}
    [msg] = wire.events_to_protos([TokenEvent(4, "x", 0, back.logprobs[7])], "r")
    [entry] = msg.logprobs
    assert entry.logprob == -0.5 and [(t.token_id, t.logprob) for t in entry.top] == [
        (4, -0.5), (2, -1.5)]
    [msg] = wire.events_to_protos([TokenEvent(4, "x", 0)], "r")
    assert list(msg.token_ids) == [4] and not msg.logprobs


def test_a_result_reads_as_the_executor_wrote_it():
    from executor_svc.step import SampledToken, StepResult as ExecutorResult
    from scheduler_svc.sampling_params import TokenLogprobs
    asked = (SampledToken(2**64 - 1, 9, -3.0), SampledToken(8, 1, -0.25, (1, 0), (-0.25, -2.0)))
    result = ExecutorResult(6, np.array([2**64 - 1, 8, 5], dtype=np.uint64),
                            np.array([9, 1, 128255]), 1.5, 2.5, asked)
    data = executor_wire.result_to_proto(result).SerializeToString()
    back = wire.result_from_proto(executor_pb2.StepResult.FromString(data))
    assert back.sampled == {2**64 - 1: 9, 8: 1, 5: 128255}
    assert (back.forward_ms, back.step_ms) == (1.5, 2.5)
    assert back.logprobs == {2**64 - 1: TokenLogprobs(-3.0, ()),
                             8: TokenLogprobs(-0.25, ((1, -0.25), (0, -2.0)))}
    empty = wire.result_from_proto(executor_pb2.StepResult(step_id=1))
    assert (empty.sampled, empty.logprobs) == ({}, {})


@pytest.mark.parametrize("fields", [
    dict(sampled=executor_pb2.SampledTokens(seq_ids=[1, 2], token_ids=[5])),
    dict(sampled=executor_pb2.SampledTokens(seq_ids=[1, 1], token_ids=[5, 6])),
    dict(logprobs=executor_pb2.SampledLogprobs(seq_ids=[1], logprobs=[-1.0, -2.0],
                                               num_top_logprobs=[0])),
    dict(logprobs=executor_pb2.SampledLogprobs(seq_ids=[1], logprobs=[-1.0], num_top_logprobs=[2],
                                               top_token_ids=[3], top_logprobs=[-1.0])),
    dict(logprobs=executor_pb2.SampledLogprobs(seq_ids=[1], logprobs=[-1.0], num_top_logprobs=[1],
                                               top_token_ids=[3], top_logprobs=[-1.0, -2.0])),
    dict(logprobs=executor_pb2.SampledLogprobs(seq_ids=[1], logprobs=[-1.0],
                                               num_top_logprobs=[2**32 - 1])),
], ids=["token-short", "seq-twice", "logprob-long", "top-short", "top-logprob-long", "top-huge"])
def test_result_columns_that_do_not_line_up_are_a_disagreement(fields):
    with pytest.raises(ExecutorDisagreement):
        wire.result_from_proto(executor_pb2.StepResult(step_id=1, **fields))


def test_bad_logit_bias_lengths_are_a_plan_mismatch():
    msg = executor_pb2.StepPlan(step_id=1, new_seqs=[executor_pb2.NewSeq(
        seq_id=1, token_ids=[1], sampling=executor_pb2.SamplingOptions(
            logit_bias_token_ids=[1, 2], logit_bias_values=[1.0]))])
    with pytest.raises(PlanMismatch, match="logit_bias"):
        executor_wire.plan_from_proto(msg)


def test_parallel_sampling_fields_of_the_public_api():
    from protos import generate_pb2
    from scheduler_svc.request import FinishEvent, RequestLimits, TokenEvent
    from scheduler_svc.sequence import FinishReason

    def n_of(**fields):
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1]), **fields)
        return wire.spec_from_proto(req, "r", RequestLimits()).n
    assert (n_of(), n_of(n=0), n_of(n=4), n_of(n=17)) == (1, 1, 4, 17)  # ranges: prepare
    [msg] = wire.events_to_protos([TokenEvent(4, "x", 2, sample_index=3)], "r")
    assert msg.sample_index == 3
    finish = wire.finish_to_proto(FinishEvent(FinishReason.EOS, 5, 2, sample_index=2), "r")
    assert finish.finished and finish.sample_index == 2


def test_queued_events_go_out_as_one_message_per_sample():
    """What piled up for a slow reader: each sample's tokens in one message, its final message
    after them, the samples in order of appearance; logprobs one entry per token."""
    from scheduler_svc.request import FinishEvent, TokenEvent
    from scheduler_svc.sampling_params import TokenLogprobs
    from scheduler_svc.sequence import FinishReason

    lp = TokenLogprobs(-0.25, ((5, -0.25),))
    events = [TokenEvent(5, "a", 3, lp, 0), TokenEvent(6, "b", 7, lp, 1),
              TokenEvent(7, "c", 4, lp, 0), TokenEvent(8, "", 8, lp, 1),
              FinishEvent(FinishReason.LENGTH, 2, 9, "!", 1), TokenEvent(9, "d", 5, lp, 0)]
    msgs = wire.events_to_protos(events, "r")
    got = [(m.sample_index, list(m.token_ids), m.text, m.index, m.finished) for m in msgs]
    assert got == [(0, [5, 7, 9], "acd", 3, False), (1, [6, 8], "b", 7, False),
                   (1, [], "!", 0, True)]
    assert [len(m.logprobs) for m in msgs] == [3, 2, 0]
    assert msgs[0].logprobs[1].logprob == -0.25 and msgs[0].logprobs[1].top[0].token_id == 5
    assert all(m.request_id == "r" for m in msgs)


@pytest.mark.parametrize("params, first", [
    (SamplingParams(), 8),  # a cached prefix: only the tokens past it travel
    (SamplingParams(temperature=0.7, repetition_penalty=1.2), 0),  # a penalty counts them all
    (SamplingParams(presence_penalty=0.5), 0),
])
def test_a_new_seq_sends_its_tokens_past_a_cached_prefix(params, first):
    tokens = list(range(100, 111))  # 11 tokens, 8 of them cached (two pages of 4)
    plan = StepPlan(3, new_seqs=[NewSeqPlan(7, tokens, [4, 5, 6], 8, 3, params, seed=1)])
    msg = executor_pb2.StepPlan.FromString(wire.plan_to_proto(plan).SerializeToString())
    assert msg.new_seqs[0].first_position == first
    assert list(msg.new_seqs[0].token_ids) == tokens[first:]
    step = executor_wire.plan_from_proto(msg)
    new = step.new_seqs[0]
    assert (new.first_position, new.num_tokens, new.token_ids) == (first, 11, tokens[first:])
    fresh = NewSeqPlan(8, tokens, [4, 5, 6], 0, 11, params, seed=1)  # nothing cached: all
    msg = wire.plan_to_proto(StepPlan(4, new_seqs=[fresh]))
    assert msg.new_seqs[0].first_position == 0 and list(msg.new_seqs[0].token_ids) == tokens


def _grpc_request(**fields) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(**fields)
    req.token_ids.ids.extend([1, 2, 3])
    return req


def _prepared(req):
    """What the Generate servicer does with a request, up to the engine's queue."""
    spec = wire.spec_from_proto(req, "r", RequestLimits())
    return prepare(spec, None, ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=None))


@pytest.mark.parametrize("sampling, stopping, field", [
    ({"temperature": float("inf")}, {}, "temperature"),
    ({"top_p": float("nan")}, {}, "top_p"),
    ({"min_p": float("nan")}, {}, "min_p"),
    ({"top_k": -2}, {}, "top_k"),
    ({"repetition_penalty": float("inf")}, {}, "repetition_penalty"),
    ({"presence_penalty": float("-inf")}, {}, "presence_penalty"),
    ({"logit_bias": {2**32 - 1: 1.0}}, {}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, {}, "logit_bias"),
    ({"logprobs": 2**32 - 1}, {}, "logprobs"),
    ({}, {"stop_token_ids": [2**32 - 1]}, "stop_token_ids"),
    ({}, {"max_tokens": 0}, "max_tokens"),
])
def test_generate_fields_are_bounded_as_the_openai_ones(sampling, stopping, field):
    req = _grpc_request(sampling=generate_pb2.SamplingParams(**sampling),
                        stopping=generate_pb2.StoppingCriteria(**stopping))
    with pytest.raises(InvalidArgument) as err:
        _prepared(req)
    assert err.value.field == field


def test_generate_extremes_the_wire_allows():
    """Each field at its carrier's extreme is either refused or fits the executor link."""
    req = _grpc_request(sampling=generate_pb2.SamplingParams(
        temperature=3.4028234663852886e38, top_k=2**31 - 1, seed=2**64 - 1, top_p=1e-45,
        repetition_penalty=3.4028234663852886e38, logit_bias={99: -100.0}, logprobs=20),
        stopping=generate_pb2.StoppingCriteria(max_tokens=2**32 - 1, min_tokens=2**32 - 1))
    _prepared(req)
    spec = wire.spec_from_proto(req, "r", RequestLimits())
    wire.plan_to_proto(StepPlan(1, new_seqs=[NewSeqPlan(1, [1], [0], 0, 1, spec.sampling,
                                                       spec.sampling.seed)]))
    too_many = _grpc_request(n=2**32 - 1)
    with pytest.raises(InvalidArgument) as err:
        _prepared(too_many)
    assert err.value.field == "n"


def test_a_top_k_past_int32_on_the_public_wire_is_refused():
    """A client that writes 2**31 into Generate's int32 top_k (a raw varint) sends -2**31."""
    top_k = bytes([0x22, 6, 0x18, 0x80, 0x80, 0x80, 0x80, 8])  # sampling { top_k: 2**31 }
    raw = _grpc_request().SerializeToString() + top_k
    with pytest.raises(InvalidArgument) as err:
        _prepared(generate_pb2.GenerateRequest.FromString(raw))
    assert err.value.field == "top_k"
