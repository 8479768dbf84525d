"""Poison isolation in the engine over a fake executor link: a request that got past validation
and fails the step (a plan the wire cannot carry, an executor that names its seq, its output
failing) ends alone with RequestFailed; the others finish with their undisturbed tokens, the step
loop never restarts, no page stays taken, and the poison seq is never sent again."""
import pytest

from test_engine import SPECS, FakeClient, run, serve
from scheduler_svc import output as output_module
from scheduler_svc import wire
from scheduler_svc.engine import Engine
from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.executor_client import ExecutorClient, ExecutorLost
from scheduler_svc.output import EngineFailed, RequestFailed
from scheduler_svc.plan import NewSeqPlan, StepPlan
from scheduler_svc.request import GenerateSpec, TokenEvent
from scheduler_svc.sampling_params import SamplingParams, StoppingParams

POISON_ID = "poison"


def poison_spec(**sampling) -> GenerateSpec:
    return GenerateSpec(prompt_token_ids=[11, 12, 13, 14, 15, 16], request_id=POISON_ID,
                        sampling=SamplingParams(**sampling), n=2,
                        stopping=StoppingParams(max_tokens=12, ignore_eos=True))


class _Call:
    """The Execute stream's write side, as far as ExecutorClient.send uses it."""

    def __init__(self) -> None:
        self.sent = []

    async def write(self, message) -> None:
        self.sent.append(message)


class WireClient(FakeClient):
    """FakeClient whose plans go through the real ExecutorClient.send first (the encoding and its
    error mapping); `refuse(plan)` may name seqs of a plan the fake executor refuses, as a real
    executor names them in its failed stream's trailing metadata."""

    def __init__(self, refuse=lambda plan: ()) -> None:
        super().__init__()
        self.real = ExecutorClient(["fake:1"])
        self.refuse = refuse
        self.sent_seeds: list[int] = []  # the seed of every new seq sent, in order
        self.named: list[int] = []  # every seq a failure named
        self._failed: ExecutorLost | None = None

    async def connect(self):
        self.real._call, self._failed = _Call(), None
        return await super().connect()

    async def send(self, plan) -> None:
        if self._failed is not None:
            raise self._failed
        try:
            await self.real.send(plan)
        except ExecutorLost as lost:
            self.named += lost.seq_ids
            raise
        self.sent_seeds += [s.seed for s in plan.new_seqs]
        named = self.refuse(plan)
        if named:  # the executor ends the stream after the results of the plans before it
            self.named += named
            self._failed = ExecutorLost("stream failed: FAILED_PRECONDITION: bad seq", named)
            return
        await super().send(plan)

    async def receive(self, plan):
        if self._failed is not None and not self._results:
            raise self._failed
        return await super().receive(plan)


async def serve_with_poison(client, poison: GenerateSpec):
    """SPECS, then `poison`, at once; returns (outputs of SPECS, the poison's, the engine)."""
    outputs, engine, _ = await serve(client, [*SPECS, poison])
    return outputs[:-1], outputs[-1], engine


def check_isolated(engine, outputs, poison_output, undisturbed, reason: str) -> None:
    assert outputs == undisturbed
    assert isinstance(poison_output, RequestFailed), poison_output
    assert POISON_ID in str(poison_output) and reason in str(poison_output)
    status = engine.status()
    assert status.loop_failures == 0 and engine.num_requests == 0
    assert status.scheduler.running == status.scheduler.waiting == 0
    assert status.scheduler.gpu_blocks_used == 0


@pytest.fixture(scope="module")
def undisturbed():
    outputs, _, _ = run(serve(FakeClient(), SPECS))
    return outputs


def test_a_plan_the_wire_cannot_carry_ends_its_request_alone(undisturbed, monkeypatch):
    # as if validation missed it: top_k past the link's int32
    monkeypatch.setattr(SamplingParams, "validate", lambda self, vocab_size=None: None)
    client = WireClient()
    outputs, poisoned, engine = run(serve_with_poison(client, poison_spec(top_k=2**31, seed=7)))
    check_isolated(engine, outputs, poisoned, undisturbed, "cannot be encoded")
    assert engine.num_resyncs == 1  # the others were recomputed on a new stream
    assert len(client.named) == 1 and client.named[0] > len(SPECS)  # the poison's first sample
    assert not {7, 8} & set(client.sent_seeds)  # neither sample ever reached the wire


def test_an_executor_that_names_a_seq_ends_its_request_only(undisturbed):
    """The executor refuses a new seq seeded 666 (standing for a value it cannot run): the request
    (both its samples) ends, the rest are recomputed, and neither sample is ever sent again."""
    client = WireClient(lambda plan: tuple(s.seq_id for s in plan.new_seqs if s.seed == 666))
    outputs, poisoned, engine = run(serve_with_poison(client, poison_spec(seed=666)))
    check_isolated(engine, outputs, poisoned, undisturbed, "bad seq")
    assert engine.num_resyncs == 1 and len(client.named) == 1
    failed_at = client.sent_seeds.index(666)
    assert not {666, 667} & set(client.sent_seeds[failed_at + 1:]), "a poison seq was resent"


def test_an_output_that_fails_ends_its_request_only(undisturbed, monkeypatch):
    text_for = output_module.RequestState.text_for

    def failing(state, token_id):
        if state.request_id == POISON_ID and state.seq.num_output_tokens > 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")
        return text_for(state, token_id)

    monkeypatch.setattr(output_module.RequestState, "text_for", failing)
    client = FakeClient()
    outputs, poisoned, engine = run(serve_with_poison(client, poison_spec()))
    check_isolated(engine, outputs, poisoned, undisturbed, "UnicodeDecodeError")
    assert engine.num_resyncs == 0 and client.num_connects == 1


def test_a_failure_no_request_explains_still_restarts_the_loop(monkeypatch):
    """A plan that does not encode although each of its new seqs does (a bug in the scheduler's
    own fields) is pinned on no request: the loop-wide restart ends every stream."""
    def broken(plan):
        raise ValueError("Value out of range: a block id")

    monkeypatch.setattr("scheduler_svc.wire.plan_to_proto", broken)
    outputs, engine, _ = run(serve(WireClient(), SPECS[:3]))
    assert all(type(o) is EngineFailed for o in outputs), outputs
    assert engine.num_loop_failures >= 1


def test_unencodable_seqs_are_found_one_by_one():
    ok = SamplingParams()
    seqs = [NewSeqPlan(1, [1, 2], [0], 0, 2, ok, 1),
            NewSeqPlan(2, [1, 2], [1], 0, 2, SamplingParams(top_k=2**31), 2),
            NewSeqPlan(3, [2**32, 2], [2], 0, 2, ok, 3),
            NewSeqPlan(4, [1, 2], [3], 0, 2, ok, 2**64)]
    plan = StepPlan(1, new_seqs=seqs)
    with pytest.raises(ValueError):
        wire.plan_to_proto(plan)
    assert wire.unencodable_seq_ids(plan) == [2, 3, 4]
    assert wire.unencodable_seq_ids(StepPlan(1, new_seqs=seqs[:1])) == []


@pytest.mark.parametrize("metadata, seq_ids", [
    ((("pagedserve-bad-seq-ids", "7"),), (7,)),
    ((("other", "x"), ("pagedserve-bad-seq-ids", "3,5")), (3, 5)),
    ((("pagedserve-bad-seq-ids", "3,x"),), ()),
    ((("pagedserve-bad-seq-ids", ",".join(["1"] * 5000)),), (1,) * 1024),
    ((), ()), (None, ())])
def test_bad_seq_ids_are_read_from_trailing_metadata(metadata, seq_ids):
    assert wire.bad_seq_ids(metadata) == seq_ids


def test_generate_raises_request_failed_after_the_tokens_before_it(monkeypatch):
    """What a client sees: the tokens before the failure, then the error naming its request."""
    text_for = output_module.RequestState.text_for

    def failing(state, token_id):
        if state.seq.num_output_tokens == 3:
            raise RuntimeError("boom")
        return text_for(state, token_id)

    monkeypatch.setattr(output_module.RequestState, "text_for", failing)
    spec = GenerateSpec(prompt_token_ids=[5, 6, 7], request_id="r1",
                        stopping=StoppingParams(max_tokens=8, ignore_eos=True))

    async def go():
        engine, events = Engine(EngineConfig(), FakeClient()), []
        await engine.start()
        try:
            with pytest.raises(RequestFailed, match="request r1 failed"):
                async for event in engine.generate(spec):
                    events.append(event)
        finally:
            await engine.stop()
        return events

    assert [(type(e), e.index) for e in run(go())] == [(TokenEvent, 0), (TokenEvent, 1)]
