"""Random Generate requests thrown at a running scheduler, and 500 concurrent streams.

Every fuzzed request gets a result or a clean gRPC error, the server stays up, and the pools are
whole at the end; the load test is bounded in time and checks memory stays flat.
"""
from __future__ import annotations

import asyncio
import string

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from protos import generate_pb2, generate_pb2_grpc
from tests.integration.harness import generate, start_services
from tests.integration.test_end_to_end import TINY, assert_pools_whole, random_prompts

pytestmark = pytest.mark.slow

CLEAN_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
VOCAB = 49152


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """One system for the fuzzing and the load: pages and running seats for 500 streams, a
    waiting queue for the rest of them."""
    running = start_services(tmp_path_factory.mktemp("fuzz"),
                             ["--model", TINY, "--max-model-len", "512", "--num-gpu-blocks",
                              "4096"],
                             ["--max-num-seqs", "256", "--max-waiting", "1000"])
    yield running
    running.stop()


token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1)),
                     max_size=700)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.one_of(st.text(max_size=300), st.text(string.printable, max_size=3000))


@st.composite
def requests(draw) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id=draw(st.text(max_size=20)))
    kind = draw(st.sampled_from(["text", "ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "ids":
        req.token_ids.ids.extend(draw(token_ids))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["user", "system", "", "x"]),
                                                     texts), max_size=3)):
            req.chat.messages.add(role=role, content=content)
    s, t = req.sampling, req.stopping
    s.temperature = draw(floats)
    if draw(st.booleans()):
        s.top_p = draw(floats)
    s.top_k = draw(st.integers(-(2**31), 2**31 - 1))
    s.min_p = draw(floats)
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        t.max_tokens = draw(st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)))
    else:
        t.max_tokens = 4  # keep the run short unless the field itself is fuzzed
    t.min_tokens = draw(st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)))
    t.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    t.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    t.ignore_eos = draw(st.booleans())
    return req


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=requests())
def test_any_request_gets_a_result_or_a_clean_error(services, req):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        try:
            messages = list(stub.Generate(req, timeout=120))
        except grpc.RpcError as err:
            assert err.code() in CLEAN_ERRORS, (err.code(), err.details())
            assert err.details()
            return
    assert messages and messages[-1].finished
    position = 0
    for m in messages[:-1]:  # a token message carries one token or several
        assert m.index == position
        position += len(m.token_ids)


def test_invalid_utf8_is_a_clean_error(services):
    # Field 1 (text), wire type 2, 2 bytes that are not UTF-8.
    raw = bytes([0x0A, 0x02, 0xC3, 0x28])
    with grpc.insecure_channel(services.scheduler_address) as channel:
        call = channel.unary_stream("/pagedserve.v1.Generator/Generate",
                                    request_serializer=lambda b: b,
                                    response_deserializer=generate_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in err.value.details()


def test_after_fuzzing_the_server_serves_and_pools_are_whole(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        ids, _, _ = generate(services.stub(channel), [11, 12, 13], max_tokens=5)
    assert len(ids) == 5
    assert_pools_whole(services)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _round(address: str, prompts: list[list[int]], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)

        async def one(prompt):
            req = generate_pb2.GenerateRequest()
            req.token_ids.ids.extend(prompt)
            req.stopping.max_tokens = max_tokens
            req.stopping.ignore_eos = True
            count = 0
            async for msg in stub.Generate(req, timeout=300):
                count += len(msg.token_ids)  # none in the final message
            return count
        return await asyncio.gather(*(one(p) for p in prompts))


def test_500_concurrent_streams_complete_with_flat_memory(services):
    pid = services.procs["scheduler"].pid
    rss = []
    for round_seed in (21, 22, 23):
        prompts = random_prompts(500, seed=round_seed, low=4, high=24)
        counts = asyncio.run(asyncio.wait_for(_round(services.scheduler_address, prompts, 16),
                                              timeout=240))
        assert counts == [16] * 500
        rss.append(_rss_mb(pid))
        assert_pools_whole(services)
    assert rss[2] - rss[1] < 50, f"scheduler RSS grew {rss} MB over rounds"
