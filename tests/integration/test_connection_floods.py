"""Connection floods against real processes (the tiny preset), the scheduler under an open-file
limit of 512 so that its derived caps are small: connections from one attacker address, idle or
each holding a request (a Health.Watch, a stream never read), replaced without pause, fill the
public gRPC port and the HTTP API past their caps while a bystander gRPC stream and HTTP stream
run. The bystanders end as undisturbed, a fresh client is served during the flood and within 1 s
after it, cut requests return their pages, the scheduler never runs out of descriptors, and a
connection that never sends the HTTP/2 preface is closed at its 5 s deadline."""
from __future__ import annotations

import collections
import json
import re
import resource
import socket
import struct
import threading
import time

import pytest
from grpc_health.v1 import health_pb2

from scheduler_svc.connection_gate import PREFACE
from tests.integration import bystanders as shared

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
def services(tmp_path_factory, tiny_executor):
    with shared.attacked_scheduler(tmp_path_factory.mktemp("floods"), tiny_executor,
                                   scheduler_preexec_fn=_lower_open_files) as s:
        s.grpc_port = int(s.scheduler_address.rsplit(":", 1)[1])
        s.silent = Silent(s.grpc_port)
        caps = re.search(r"connections open at once: HTTP (\d+).*?gRPC (\d+)",
                         s.log_of("scheduler"))
        s.http_cap, s.grpc_cap = int(caps[1]), int(caps[2])
        s.reference = (grpc_tokens(s), http_text(s))  # undisturbed
        yield s
    log = s.log_of("scheduler")
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
    return shared.grpc_tokens(services, PROMPT, max_tokens, started, OWN_CONNECTION)


def http_text(services, max_tokens: int = BYSTANDER_TOKENS, started=None) -> str:
    return shared.http_text(services, PROMPT, max_tokens, started)


def bystanders(services):
    return shared.bystanders(services, PROMPT, BYSTANDER_TOKENS, grpc_options=OWN_CONNECTION)


def assert_fresh_clients_served(services, within_s: float = 1.0) -> None:
    shared.assert_fresh_clients_served(services, PROMPT, within_s, OWN_CONNECTION)


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


def _h2_frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, stream) + payload


def _literal(index: int, value: str) -> bytes:  # HPACK: a literal header of an indexed name
    return bytes([0x40 | index, len(value)]) + value.encode()


_WATCH = health_pb2.HealthCheckRequest().SerializeToString()
# The preface, an empty SETTINGS frame, then stream 1: a whole Health.Watch request (:method POST,
# :scheme http, :path, :authority, content-type, te), answered until the client goes
WATCH_CALL = (PREFACE + _h2_frame(4, 0, 0) + _h2_frame(1, 0x4, 1, (
    b"\x83\x86" + _literal(4, "/grpc.health.v1.Health/Watch") + _literal(1, "x")
    + _literal(31, "application/grpc") + b"\x40\x02te\x08trailers"))
    + _h2_frame(0, 0x1, 1, struct.pack(">BI", 0, len(_WATCH)) + _WATCH))
_STREAM_BODY = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
STREAM_CALL = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(_STREAM_BODY) + _STREAM_BODY)


def _established(sock: socket.socket) -> bool:
    """Whether the server has not closed the connection (TCP_INFO's state), read without
    reading what it sent."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == 1  # TCP_ESTABLISHED


class Squatters:
    """Connections from ATTACKER to `port`, up to `size` at once, each sending `call` (a request
    answered for long) and never reading the answer; one the server closes is replaced at once,
    as long as it runs. `size` over the cap: the attacker's newcomers keep coming."""

    def __init__(self, port: int, size: int, call: bytes) -> None:
        self.port, self.size, self.call = port, size, call
        self.held = self.lost = 0  # open now; closed by the server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Squatters:
        self._thread.start()
        deadline = time.monotonic() + 10
        while self.lost < 10 and time.monotonic() < deadline:  # the cap reached
            time.sleep(0.01)
        assert self.lost >= 10, "the attack never filled the cap"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        conns: list[socket.socket] = []
        while not self._stop.is_set():
            for sock in [s for s in conns if not _established(s)]:
                conns.remove(sock)
                sock.close()
                self.lost += 1
            if len(conns) < self.size:
                try:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=2,
                                                    source_address=(ATTACKER, 0))
                    sock.sendall(self.call)
                    conns.append(sock)
                except OSError:
                    pass
            self.held = len(conns)
            time.sleep(0.005)
        for sock in conns:
            sock.close()


def requests_in_engine(services) -> int:
    status = services.status()
    return status.running + status.waiting + status.swapped


def assert_pages_whole(services) -> None:
    """No request left in the engine and no KV page in use: every cut request was aborted."""
    deadline = time.monotonic() + 10
    while (status := services.status()).gpu_blocks_used or requests_in_engine(services):
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def test_busy_grpc_connections_from_one_address_lock_no_client_out(services):
    """Each of the attacker's connections holds a Health.Watch (free to ask, answered until the
    client goes): a newcomer from another address takes the place of the least recently active
    one, whose call ends; the attacker's own newcomers are closed."""
    with bystanders(services):
        with Squatters(services.grpc_port, services.grpc_cap + 2, WATCH_CALL) as attack:
            for _ in range(2):
                assert_fresh_clients_served(services)
            assert attack.held >= services.grpc_cap - 2  # it kept all but the places it lost
    assert_fresh_clients_served(services)
    assert "closed ones with calls in progress of peers holding more" in services.log_of(
        "scheduler")


def test_busy_http_connections_from_one_address_lock_no_client_out(services):
    """Each of the attacker's connections holds a completion stream whose answer it never reads:
    a newcomer from another address takes the place of the least recently active one, whose
    request is aborted as after a disconnect, its pages returned."""
    with bystanders(services):
        with Squatters(services.http_port, services.http_cap + 2, STREAM_CALL):
            # the cap's worth of running streams slows each step on the CPU backend: the fresh
            # client is let in at once (not 429), and answered at the engine's pace
            assert_fresh_clients_served(services, within_s=5.0)
            # no stream cut for it goes on: the engine holds no more requests than the cap's
            # connections and the gRPC bystander
            deadline = time.monotonic() + 5
            while requests_in_engine(services) > services.http_cap + 1:
                assert time.monotonic() < deadline, services.status()
                time.sleep(0.05)
    assert_fresh_clients_served(services)
    assert "cut requests of peers holding more" in services.log_of("scheduler")
    assert_pages_whole(services)
