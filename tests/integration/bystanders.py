"""Bystander streams for attack tests: a greedy gRPC stream and a streamed HTTP completion, started
before an attack and compared, once it is over, with what they give undisturbed."""
from __future__ import annotations

import http.client
import json
import threading
import time
from contextlib import contextmanager

import grpc

from tests.integration.harness import attach_scheduler, generate


@contextmanager
def attacked_scheduler(tmp_path, executor, scheduler_args=(), **kwargs):
    """A scheduler of its own flags attached to `executor`, for a module of attacks; once it is
    stopped its log must hold no traceback and no ERROR line (an attack is refused, never
    crashes or errs)."""
    s = attach_scheduler(tmp_path, executor, scheduler_args, **kwargs)
    try:
        yield s
    finally:
        s.stop()
    log = s.log_of("scheduler")
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def grpc_tokens(services, prompt: list[int], max_tokens: int, started=None,
                options=()) -> list[int]:
    """A greedy gRPC stream's tokens; `started` is set once its channel is connected."""
    with grpc.insecure_channel(services.scheduler_address, options=options) as channel:
        if started is not None:
            grpc.channel_ready_future(channel).result(timeout=10)
            started.set()
        return generate(services.stub(channel), prompt, max_tokens=max_tokens, timeout=60)[0]


def http_text(services, prompt: list[int], max_tokens: int, started=None) -> str:
    """A streamed greedy completion's text, read chunk by chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}), {"content-type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        pieces = []
        for line in reply:
            if started is not None:
                started.set()
            if line.startswith(b"data: {"):
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(pieces)
    finally:
        conn.close()


@contextmanager
def bystanders(services, prompt: list[int], max_tokens: int, grpc_options=()):
    """A gRPC and an HTTP stream, connected before the attack runs, ending as undisturbed
    (`services.reference`: their undisturbed (tokens, text))."""
    results, threads = {}, []
    runs = (("grpc", lambda e: grpc_tokens(services, prompt, max_tokens, e, grpc_options)),
            ("http", lambda e: http_text(services, prompt, max_tokens, e)))
    for name, run in runs:
        started = threading.Event()
        thread = threading.Thread(target=lambda n=name, r=run, e=started: results.__setitem__(
            n, r(e)), daemon=True)
        thread.start()
        assert started.wait(30), f"the {name} bystander never started"
        threads.append(thread)
    yield
    for thread in threads:
        thread.join(60)
    assert (results.get("grpc"), results.get("http")) == services.reference


def assert_fresh_clients_served(services, prompt: list[int], within_s: float = 1.0,
                                grpc_options=()) -> None:
    """A new HTTP connection and a new gRPC channel, each answered within `within_s`."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=5)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}),
                 {"content-type": "application/json"})
    assert conn.getresponse().status == 200
    conn.close()
    assert time.monotonic() - started < within_s
    started = time.monotonic()
    assert len(grpc_tokens(services, prompt, 2, options=grpc_options)) == 2
    assert time.monotonic() - started < within_s
