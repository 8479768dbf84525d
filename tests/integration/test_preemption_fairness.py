"""Issue 25 on real processes (preset:tiny, a small KV cache): a small request admitted after wide
n-sample streams that never read finishes with its undisturbed tokens while they still run, and
a fresh client is served within 1 s once they are cancelled."""
from __future__ import annotations

import time

import grpc
import pytest

from protos import generate_pb2
from tests.integration.harness import generate, start_services

pytestmark = pytest.mark.slow

TINY = "preset:tiny"
# 64 pages of 16 tokens. The 24 wide samples start on a page each (an 8-token prompt) and, a token
# a step, want 25 pages each: the pool runs short ~24 steps after they start, while the small
# request (sent as they start, 64 tokens) runs. Greedy: the CPU sampler is slow at temperature > 0.
NUM_GPU_BLOCKS = 64
NUM_WIDE, WIDE_N, WIDE_TOKENS = 3, 8, 384
SMALL_PROMPT = [17, 2, 400, 33, 90, 61, 5, 7]
SMALL_TOKENS = 64
# Generous: what the newest-victim rule fails is the check that no wide sample has finished.
MAX_SMALL_S = 10.0
FRESH_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    services = start_services(tmp_path_factory.mktemp("fairness"),
                              ["--model", TINY, "--num-gpu-blocks", str(NUM_GPU_BLOCKS)])
    yield services
    services.stop()


def _wide_request(i: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[300 + i, 11, 12, 13, 14, 15, 16, 17]), n=WIDE_N,
        stopping=generate_pb2.StoppingCriteria(max_tokens=WIDE_TOKENS, ignore_eos=True))


def _wait_running(services, num_seqs: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while services.status().running < num_seqs:
        assert time.monotonic() < deadline, services.status()


def test_a_small_request_finishes_while_wide_streams_that_never_read_hold_the_pool(services):
    with grpc.insecure_channel(services.scheduler_address) as channel:
        stub = services.stub(channel)
        undisturbed, _, _ = generate(stub, SMALL_PROMPT, max_tokens=SMALL_TOKENS)
        # Started and never read: the server generates on, their tokens queued for them.
        wide = [stub.Generate(_wide_request(i), timeout=120) for i in range(NUM_WIDE)]
        try:
            _wait_running(services, NUM_WIDE * WIDE_N)  # so the small request is the newest
            preempted_before = _num_preemptions(services)
            start = time.monotonic()
            ids, _, _ = generate(stub, SMALL_PROMPT, max_tokens=SMALL_TOKENS, timeout=60)
            took = time.monotonic() - start
            status = services.status()
        finally:
            for call in wide:
                call.cancel()
        assert ids == undisturbed
        assert _num_preemptions(services) > preempted_before, "the pool never ran short"
        # Every wide sample was still unfinished: the small request did not wait for them (as the
        # newest running request, it would be preempted each time the pool ran short).
        assert status.running + status.swapped + status.waiting >= NUM_WIDE * WIDE_N, status
        assert took < MAX_SMALL_S, took
        start = time.monotonic()
        fresh, _, _ = generate(stub, [9, 8, 7], max_tokens=4, timeout=10)
        assert len(fresh) == 4 and time.monotonic() - start < FRESH_WITHIN_S


def _num_preemptions(services) -> float:
    m = services.metrics()
    return sum(v for k, v in m.items() if k.startswith("pagedserve_preemptions_total"))
