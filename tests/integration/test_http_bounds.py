"""Attacks on the scheduler's listeners, each against real processes (the tiny preset) while a
bystander gRPC stream and a bystander HTTP stream run: huge and countless headers, slow and idle
connections, a connection flood on each port, a mid-upload disconnect, huge JSON bodies that are
slow to parse. Each bystander must end
with the tokens it gets undisturbed, and a fresh client must be served within 1 s after the attack
stops. One pair of services, with small caps and timeouts, serves the module."""
from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest

from protos import generate_pb2
from tests.integration import bystanders as shared

pytestmark = pytest.mark.slow

HTTP_CAP, GRPC_CAP = 16, 8
TIMEOUT_S = 2.0  # header, body and keep-alive timeouts of the scheduler under attack
PROMPT = [5, 6, 7]
BYSTANDER_TOKENS = 400


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_executor):
    with shared.attacked_scheduler(tmp_path_factory.mktemp("http_bounds"), tiny_executor, [
            "--http-max-connections", str(HTTP_CAP), "--grpc-max-connections", str(GRPC_CAP),
            "--http-header-timeout", str(TIMEOUT_S), "--http-body-timeout", str(TIMEOUT_S),
            "--http-keep-alive-timeout", str(TIMEOUT_S)]) as s:
        s.reference = (grpc_tokens(s), http_text(s))  # undisturbed
        yield s


def grpc_tokens(services, max_tokens: int = BYSTANDER_TOKENS, started=None) -> list[int]:
    return shared.grpc_tokens(services, PROMPT, max_tokens, started)


def http_text(services, max_tokens: int = BYSTANDER_TOKENS, started=None) -> str:
    return shared.http_text(services, PROMPT, max_tokens, started)


def bystanders(services):
    return shared.bystanders(services, PROMPT, BYSTANDER_TOKENS)


def assert_fresh_clients_served(services) -> None:
    shared.assert_fresh_clients_served(services, PROMPT)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def answer(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    out = b""
    try:
        while data := sock.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out


def drip(sock: socket.socket, data: bytes, chunk: int, pause_s: float = 0.0) -> bytes:
    """Sends `data` a chunk at a time until the server answers; then its whole answer."""
    for i in range(0, len(data), chunk):
        if select.select([sock], [], [], 0)[0]:
            break
        try:
            sock.sendall(data[i:i + chunk])
        except OSError:
            break
        time.sleep(pause_s)
    return answer(sock)


def pending(sock: socket.socket) -> bytes | None:
    """What the server sent so far: b"" if it closed the connection, None if nothing yet."""
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""


def test_huge_and_countless_headers_are_431(services):
    with bystanders(services):
        huge = connect(services.http_port)
        reply = drip(huge, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (100 << 20),
                     chunk=1 << 16)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
        assert b"headers are over 65536 bytes" in reply
        many = connect(services.http_port)
        reply = drip(many, b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-a: b\r\n" * 10_000,
                     chunk=1 << 12)
        assert reply.startswith(b"HTTP/1.1 431 ")
        few = connect(services.http_port)
        few.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-a: b\r\n" * 257 + b"\r\n")
        assert b"more than 256 request headers" in answer(few)
    assert_fresh_clients_served(services)


def test_slow_and_idle_connections_are_closed(services):
    with bystanders(services):
        idle, slow, body, kept = (connect(services.http_port) for _ in range(4))
        started = time.monotonic()
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: 1000\r\n\r\n{\"prompt\"")
        kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        slow.sendall(b"GET /health HTTP/1.1\r\nx-slow: ")
        assert drip(slow, b"a" * 100, chunk=1, pause_s=0.1).startswith(b"HTTP/1.1 408 ")
        assert answer(idle) == b""
        assert answer(body).startswith(b"HTTP/1.1 408 ")
        assert answer(kept).startswith(b"HTTP/1.1 200 ")  # then closed after the keep-alive
        assert time.monotonic() - started < 3 * TIMEOUT_S
    assert_fresh_clients_served(services)


def test_a_mid_upload_disconnect_is_quiet(services):
    upload = connect(services.http_port)
    upload.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                   b"application/json\r\ncontent-length: 100000\r\n\r\n" + b" " * 50_000)
    time.sleep(0.2)  # the server is reading the body
    upload.close()
    assert_fresh_clients_served(services)  # and the module's end finds no ERROR in the log


def test_an_http_connection_flood_is_429_and_grpc_serves(services):
    """Connections each reading a request (not idle: none makes room for a newcomer)."""
    with bystanders(services):
        flood = []
        for _ in range(HTTP_CAP + 8):
            flood.append(connect(services.http_port))
            flood[-1].sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(0.005)
        time.sleep(0.3)
        replies = [pending(sock) for sock in flood]
        refused = [reply for reply in replies if reply]
        assert len(refused) >= 8 and replies.count(None) >= HTTP_CAP - 4, replies
        for reply in refused:
            assert reply.startswith(b"HTTP/1.1 429 ") and b"\r\nretry-after: 1\r\n" in reply
        assert len(grpc_tokens(services, max_tokens=2)) == 2  # gRPC serves meanwhile
        for sock in flood:
            sock.close()
    assert_fresh_clients_served(services)


def test_a_grpc_connection_flood_is_closed_beyond_the_cap(services):
    with bystanders(services):
        port = int(services.scheduler_address.rsplit(":", 1)[1])
        flood = [connect(port) for _ in range(GRPC_CAP + 8)]
        time.sleep(0.3)
        replies = [pending(sock) for sock in flood]
        assert replies.count(b"") >= 8, replies
        for sock in flood:
            sock.close()
    assert_fresh_clients_served(services)


# --- huge JSON bodies (parsed in child processes: scheduler_svc/body_parser.py) ---------------

MAX_GAP_S = 0.5  # for a bystander's first token, and between two of its messages


def timed_grpc_tokens(services) -> tuple[list[int], float]:
    """A gRPC stream's tokens and the longest wait for one of its messages (the first too)."""
    with grpc.insecure_channel(services.scheduler_address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        req = generate_pb2.GenerateRequest()
        req.token_ids.ids.extend(PROMPT)
        req.stopping.max_tokens, req.stopping.ignore_eos = BYSTANDER_TOKENS, True
        ids, gaps, last = [], [], time.monotonic()
        for msg in services.stub(channel).Generate(req, timeout=60):
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
            ids.extend(msg.token_ids)
        return ids, max(gaps)


def timed_http_text(services) -> tuple[str, float]:
    """A streamed greedy completion's text and the longest wait for one of its events."""
    conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=60)
    try:
        last = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": PROMPT, "max_tokens": BYSTANDER_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}), {"content-type": "application/json"})
        reply = conn.getresponse()
        pieces, gaps = [], []
        for line in reply:
            if line.startswith(b"data: {"):
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(pieces), max(gaps)
    finally:
        conn.close()


@contextmanager
def streaming_bystanders(services):
    """A gRPC and an HTTP bystander, each streaming one request after another until the block
    ends; yields {name: [(output, longest wait)]}, a run of each done before the block runs."""
    results, threads, done = {"grpc": [], "http": []}, [], threading.Event()

    def stream(name, run):
        while not done.is_set() or not results[name]:
            results[name].append(run(services))
    for name, run in (("grpc", timed_grpc_tokens), ("http", timed_http_text)):
        threads.append(threading.Thread(target=stream, args=(name, run), daemon=True))
        threads[-1].start()
    while not all(results.values()):
        time.sleep(0.01)
    try:
        yield results
    finally:
        done.set()
        for thread in threads:
            thread.join(60)


def post(services, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=60)
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def huge_bodies() -> list[tuple[str, bytes, str]]:
    """(path, body, its 400's message) of bodies near the 3 MiB limit, each slow to parse: 290k
    unknown keys, 100k chat messages."""
    keys = ",".join(f'"{i:x}":0' for i in range(290_000))
    messages = ",".join(['{"role":"user","content":"x"}'] * 100_000)
    bodies = [("/v1/completions", f'{{"prompt":{PROMPT},{keys}}}'.encode(),
               "0: one of 290000 fields beyond the API's; at most 128 are accepted"),
              ("/v1/chat/completions", f'{{"messages":[{messages}]}}'.encode(),
               "messages: at most 1024 messages, got 100000")]
    assert all(2_800_000 <= len(body) <= 3 << 20 for _, body, _ in bodies)
    return bodies


def test_huge_json_bodies_stall_no_stream(services):
    """8 huge bodies posted at once while a gRPC and an HTTP bystander stream: each body gets its
    400; every bystander stream is unchanged and never waits over MAX_GAP_S for a token."""
    bodies = huge_bodies() * 4
    with streaming_bystanders(services) as results:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(services, b[0], b[1]), bodies))
    for (status, reply), (_, _, message) in zip(answers, bodies):
        assert (status, reply["error"]["message"]) == (400, message)
    for name, reference in zip(("grpc", "http"), services.reference):
        assert all(output == reference for output, _ in results[name]), name
        waits = [wait for _, wait in results[name]]
        assert max(waits) < MAX_GAP_S, (name, waits)
    assert_fresh_clients_served(services)
