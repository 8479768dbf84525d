"""benchmarks/chaos_soak.py: its checker catches a missing, duplicated or changed token in either
API's stream, and a short real soak (a kill and a long stop forced early) fails no request and
reports the one mismatch injected into its reference."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from protos import generate_pb2
from tests.benchmarks.conftest import BENCHMARKS

import chaos_soak  # benchmarks/ is on the path (conftest)
from chaos_soak import Outcome, Spec, compare, read_sse, run_grpc

GREEDY = Spec(0, "grpc", (5, 6, 7), max_tokens=3, n=1, seed=None)


def outcome(tokens: list, finish: str = "FINISH_REASON_LENGTH", logprobs=None) -> Outcome:
    return Outcome(0, "grpc", [list(tokens)], ["".join(map(str, tokens))],
                   [list(logprobs or [])], [finish])


@pytest.mark.parametrize("tokens, finish, logprobs", [
    ([11, 12], "FINISH_REASON_LENGTH", None),  # missing
    ([11, 12, 12, 13], "FINISH_REASON_LENGTH", None),  # duplicated
    ([11, 14, 13], "FINISH_REASON_LENGTH", None),  # changed
    ([11, 12, 13], "FINISH_REASON_STOP", None),
    ([11, 12, 13], "FINISH_REASON_LENGTH", [-1.0, -2.0, -3.1]),  # same text, other token
])
def test_compare_names_the_difference(tokens, finish, logprobs):
    expected = outcome([11, 12, 13], logprobs=[-1.0, -2.0, -3.0])
    assert compare(expected, outcome(tokens, finish, logprobs or [-1.0, -2.0, -3.0]))
    assert compare(expected, outcome([11, 12, 13], logprobs=[-1.0, -2.0, -3.0])) is None


class FakeStub:
    def __init__(self, messages) -> None:
        self.messages = messages

    def Generate(self, request, timeout):  # noqa: N802 - gRPC's method name
        return iter(self.messages)


def test_grpc_stream_index_out_of_step_is_a_problem():
    duplicated = [generate_pb2.GenerateResponse(token_ids=[11], index=0),
                  generate_pb2.GenerateResponse(token_ids=[12], index=1),
                  generate_pb2.GenerateResponse(token_ids=[12], index=1),
                  generate_pb2.GenerateResponse(finished=True, completion_tokens=2,
                                                finish_reason=generate_pb2.FINISH_REASON_LENGTH)]
    out = run_grpc(FakeStub(duplicated), GREEDY, timeout=5)
    assert out.tokens == [[11, 12, 12]] and out.error is None
    assert out.problems == ["sample 0: index 1 after 2 tokens",
                            "sample 0: completion_tokens 2, 3 streamed"]
    assert run_grpc(FakeStub(duplicated[:2] + duplicated[3:]), GREEDY, 5).problems == []


def sse(*chunks) -> io.BytesIO:
    lines = [f"data: {json.dumps(c)}\n\n" if isinstance(c, dict) else f"data: {c}\n\n"
             for c in chunks]
    return io.BytesIO("".join(lines).encode())


def token_chunk(text: str, offset: int) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": {
        "tokens": [text], "token_logprobs": [-1.0], "text_offset": [offset]}}]}


def test_http_stream_offsets_usage_and_done_are_checked():
    end = {"choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}]}
    usage = {"choices": [], "usage": {"completion_tokens": 2}}
    whole = Outcome.empty(GREEDY)
    read_sse(sse(token_chunk("a", 0), token_chunk("b", 1), end, usage, "[DONE]"), whole)
    assert (whole.tokens, whole.texts, whole.problems, whole.error) == ([["a", "b"]], ["ab"], [],
                                                                          None)
    missing = Outcome.empty(GREEDY)  # the first token's chunk lost
    read_sse(sse(token_chunk("b", 1), end, usage, "[DONE]"), missing)
    assert missing.problems == ["sample 0: text offsets [1] after 0 characters",
                                "usage counts 2 tokens, 1 streamed"]
    cut = Outcome.empty(GREEDY)
    read_sse(sse(token_chunk("a", 0)), cut)
    assert cut.error == "the stream ended without [DONE]"


@pytest.mark.slow
def test_short_soak_fails_no_request_and_reports_the_injected_mismatch(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "chaos_soak.py"), "--duration", "8", "--interval",
         "1.5", "2.5", "--force", "kill,stop-long", "--step-timeout", "1.5", "--requests", "12",
         "--scale", "0.15", "--reference-concurrency", "8", "--inject-mismatch", "--log-dir",
         str(tmp_path / "logs"), "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr  # the injected mismatch fails the soak
    result = json.loads(out.read_text())
    soak = result["soak"]
    assert not result["passed"] and "FAILED" in run.stdout
    assert soak["failures"] == [] and soak["stream_problems"] == [], soak
    assert soak["mismatches"] and {m["spec"] for m in soak["mismatches"]} == {0}
    assert (soak["kills"], soak["stops_long"], soak["chaos_error"]) == (1, 1, None)
    assert soak["resyncs"] >= 2 and soak["loop_failures"] == 0
    assert soak["grpc_requests"] and soak["http_requests"]
    assert soak["requests"] > 12  # more than the pool: round it again
    assert sum(chaos_soak.preemptions(soak["after"]).values()) > 0
    assert soak["after"]["whole"] and soak["after"]["executor_attached"]
