"""Connection floods against real processes (the tiny preset), the scheduler under an open-file
limit of 512 so that its derived caps are small: idle connections from one attacker address,
replaced without pause, fill the public gRPC port and the HTTP API past their caps while a
bystander gRPC stream and HTTP stream run. The bystanders end as undisturbed, a fresh client is
served within 1 s during the flood and after it, the scheduler never runs out of descriptors, and
a connection that never sends the HTTP/2 preface is closed at its 5 s deadline."""
from __future__ import annotations

import collections
import http.client
import json
import re
import resource
import socket
import threading
import time
from contextlib import contextmanager

import grpc
import pytest

from tests.integration.harness import generate, start_services

pytestmark = pytest.mark.slow

OPEN_FILES = 512
ATTACKER = "127.0.0.2"  # the flood's address; every other client is 127.0.0.1 or LONE
LONE = "127.0.0.9"
PROMPT = [5, 6, 7]
BYSTANDER_TOKENS = 600
# a channel of its own: grpc shares one connection among a process's channels to one address
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def _lower_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    s = start_services(tmp_path_factory.mktemp("floods"), ["--model", "preset:tiny"],
                       scheduler_preexec_fn=_lower_open_files)
    try:
        s.grpc_port = int(s.scheduler_address.rsplit(":", 1)[1])
        s.silent = Silent(s.grpc_port)
        caps = re.search(r"connections open at once: HTTP (\d+).*?gRPC (\d+)",
                         s.log_of("scheduler"))
        s.http_cap, s.grpc_cap = int(caps[1]), int(caps[2])
        s.reference = (grpc_tokens(s), http_text(s))  # undisturbed
        yield s
    finally:
        s.stop()
    log = s.log_of("scheduler")
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert "cannot accept connections" not in log, log[-3000:]  # never out of descriptors


class Silent:
    """A connection from LONE to the gRPC port that sends nothing; `lasted` says how long it
    stayed open (None while it is)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), source_address=(LONE, 0))
        self.opened, self.lasted = time.monotonic(), None
        self.closed = threading.Event()
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            pass
        self.lasted = time.monotonic() - self.opened
        self.closed.set()


class Flood:
    """`size` idle connections from ATTACKER to `port`, the oldest closed for a new one without
    pause, as long as it runs; `send` goes first on each (the HTTP/2 preface: proven clients
    that the gate's deadline does not end)."""

    def __init__(self, port: int, size: int, send: bytes = b"") -> None:
        self.port, self.size, self.send = port, size, send
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        deadline = time.monotonic() + 10
        while self.opened < 2 * self.size and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.opened >= 2 * self.size, "the flood never got going"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        conns: collections.deque[socket.socket] = collections.deque()
        while not self._stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=2,
                                                source_address=(ATTACKER, 0))
                sock.sendall(self.send)
                conns.append(sock)
                self.opened += 1
            except OSError:
                pass
            if len(conns) > self.size:
                conns.popleft().close()
            time.sleep(0.001)
        for sock in conns:
            sock.close()


def grpc_tokens(services, max_tokens: int = BYSTANDER_TOKENS, started=None) -> list[int]:
    with grpc.insecure_channel(services.scheduler_address, options=OWN_CONNECTION) as channel:
        if started is not None:
            grpc.channel_ready_future(channel).result(timeout=10)
            started.set()
        return generate(services.stub(channel), PROMPT, max_tokens=max_tokens, timeout=60)[0]


def http_text(services, max_tokens: int = BYSTANDER_TOKENS, started=None) -> str:
    """A streamed greedy completion's text, read chunk by chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
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
def bystanders(services):
    """A gRPC and an HTTP stream, connected before the attack runs, ending as undisturbed."""
    results, threads = {}, []
    for name, run in (("grpc", grpc_tokens), ("http", http_text)):
        started = threading.Event()
        thread = threading.Thread(target=lambda n=name, r=run, e=started: results.__setitem__(
            n, r(services, started=e)), daemon=True)
        thread.start()
        assert started.wait(30), f"the {name} bystander never started"
        threads.append(thread)
    yield
    for thread in threads:
        thread.join(60)
    assert (results.get("grpc"), results.get("http")) == services.reference


def assert_fresh_clients_served(services) -> None:
    """A new HTTP connection and a new gRPC connection, each answered within 1 s."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", services.http_port, timeout=5)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                 {"content-type": "application/json"})
    assert conn.getresponse().status == 200
    conn.close()
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert len(grpc_tokens(services, max_tokens=2)) == 2
    assert time.monotonic() - started < 1.0


def test_a_grpc_connection_flood_locks_no_client_out(services):
    with bystanders(services):
        for send in (b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):  # unproven, then proven
            with Flood(services.grpc_port, services.grpc_cap + 20, send):
                assert_fresh_clients_served(services)
                assert_fresh_clients_served(services)
    assert_fresh_clients_served(services)


def test_an_http_connection_flood_locks_no_client_out(services):
    with bystanders(services):
        with Flood(services.http_port, services.http_cap + 40):
            assert_fresh_clients_served(services)
            assert_fresh_clients_served(services)
    assert_fresh_clients_served(services)


def test_a_connection_without_the_http2_preface_is_closed_at_its_deadline(services):
    """Opened as the module's services started, from an address of its own: the floods before
    took the place of their own connections, never of this one."""
    assert services.silent.closed.wait(10)
    assert 4.5 <= services.silent.lasted <= 7.0, services.silent.lasted
