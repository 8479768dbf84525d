"""The public gRPC port's gate in-process, in front of the real public grpc server: the preface
deadline, idle connections closed for newcomers at the cap, connections with streams being
answered closed only for a newcomer of another peer while theirs holds more than its share, the
client's address as grpc's peer, and the frame headers followed across any read.
Against real processes, with bystanders: tests/integration/test_connection_floods.py."""
import asyncio
import dataclasses
import logging
import os
import socket
import struct

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import admin_pb2, admin_pb2_grpc
from scheduler_svc.connection_gate import PREFACE, GateLimits, _Frames
from scheduler_svc.server import Listeners, build_servers

LIMITS = GateLimits(max_connections=2, preface_timeout_s=5, stall_s=0.2)
# a channel of its own: grpc shares one connection among a process's channels to one address
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
SETTINGS = struct.pack(">IBI", 0 << 8 | 4, 0, 0)  # an empty SETTINGS frame


WATCHED = health_pb2.HealthCheckRequest(service="x")


def channel_to(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION)


def run(test, limits: GateLimits = LIMITS):
    async def main():
        public, admin, health, port, _ = build_servers(object(), Listeners(
            public="127.0.0.1:0", admin="127.0.0.1:0", gate=limits))
        await public.start()
        try:
            await asyncio.wait_for(test(port, public, health), 30)
        finally:
            await public.stop(None)
            await admin.stop(None)
        return public
    return asyncio.run(main())


async def raw(port: int, host: str = "127.0.0.2", send: bytes = b""):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    writer.write(send)
    return reader, writer


async def closed(conn, timeout: float = 2.0) -> bool:
    """Whether the gate closes the connection (reader, writer) within `timeout`; what it sent
    first is skipped."""
    reader = conn[0]
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def check(port: int) -> int:
    async with channel_to(port) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def test_a_connection_without_the_preface_is_closed_at_its_deadline():
    async def test(port, public, health):
        loop = asyncio.get_running_loop()
        silent = await raw(port)
        half = await raw(port, send=PREFACE[:10])
        other = await raw(port, send=b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        proven = await raw(port, send=PREFACE + SETTINGS)
        started = loop.time()
        assert await closed(other, timeout=0.2)  # not HTTP/2: at once
        assert await closed(silent) and await closed(half)
        assert 0.25 < loop.time() - started < 1.0
        assert not await closed(proven, timeout=0.5)  # grpc's own handshake deadline is 10 s
    run(test, dataclasses.replace(LIMITS, max_connections=8, preface_timeout_s=0.3))


def test_at_the_cap_idle_connections_make_room_and_a_peers_own_newcomer_cuts_no_stream():
    async def test(port, public, health):
        async with channel_to(port) as watching:
            watch = health_pb2_grpc.HealthStub(watching).Watch(WATCHED)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            idle = await raw(port)  # the cap of 2 is full: a stream and an idle connection
            assert await check(port) == health_pb2.HealthCheckResponse.SERVING
            assert await closed(idle)  # made room for the newcomer
            await health.set("x", health_pb2.HealthCheckResponse.SERVING)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            async with channel_to(port) as second:
                watch2 = health_pb2_grpc.HealthStub(second).Watch(WATCHED)
                await watch2.read()  # both connections answer a stream: nothing idle
                refused = await raw(port, host="127.0.0.1")  # the peer holding both
                assert await closed(refused, timeout=0.5)
                await health.set("x", health_pb2.HealthCheckResponse.NOT_SERVING)
                for stream in (watch, watch2):
                    assert (await stream.read()).status == (
                        health_pb2.HealthCheckResponse.NOT_SERVING)
    run(test)


def test_a_peer_over_its_share_loses_its_least_recently_active_stream_to_another_peer():
    """127.0.0.1 holds both places with a stream each: a newcomer from 127.0.0.2 takes the place
    of the older (its call ends UNAVAILABLE); with one place each, all busy, newcomers are
    closed."""
    async def test(port, public, health):
        async with channel_to(port) as first, channel_to(port) as second:
            watches = []
            for channel in (first, second):  # the first the least recently active
                watches.append(health_pb2_grpc.HealthStub(channel).Watch(WATCHED))
                await watches[-1].read()
                await asyncio.sleep(0.05)
            newcomer = await raw(port, send=PREFACE + SETTINGS + watch_request())
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await watches[0].read()
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            for host in ("127.0.0.2", "127.0.0.3"):  # one place each: nobody over its share
                assert await closed(await raw(port, host=host), timeout=0.5)
            assert not await closed(newcomer, timeout=0.1)
            await health.set("x", health_pb2.HealthCheckResponse.SERVING)
            assert (await watches[1].read()).status == health_pb2.HealthCheckResponse.SERVING
    run(test)


def test_a_stalled_stream_request_makes_room_once_stalled():
    """A stream whose request has not ended (no END_STREAM) counts as reading: it is kept while
    its bytes come, and makes room once they stop."""
    async def test(port, public, health):
        headers = frame(1, 0x4, 1, request_headers("/grpc.health.v1.Health/Watch"))  # open
        async with channel_to(port) as watching:
            watch = health_pb2_grpc.HealthStub(watching).Watch(WATCHED)
            await watch.read()
            stalled = await raw(port, send=PREFACE + SETTINGS + headers)
            refused = await raw(port)
            assert await closed(refused, timeout=0.3)
            assert not await closed(stalled, timeout=0.1)
            await asyncio.sleep(0.6)
            assert await check(port) == health_pb2.HealthCheckResponse.SERVING
            assert await closed(stalled)
            await health.set("x", health_pb2.HealthCheckResponse.SERVING)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    run(test, dataclasses.replace(LIMITS, stall_s=0.6))


def test_grpc_sees_the_clients_address_behind_the_gate(caplog):
    async def test(port, public, health):
        async with channel_to(port) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest())
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with caplog.at_level(logging.WARNING, "scheduler_svc.server"):
        run(test)
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert " from ipv4:127.0.0.1:" in line, line


def test_stopping_closes_the_port_and_removes_the_socket_directory():
    async def test(port, public, health):
        assert await check(port) == health_pb2.HealthCheckResponse.SERVING
        assert os.stat(public.socket_dir.path).st_mode & 0o777 == 0o700
        test.port = port
    public = run(test)
    assert not os.path.exists(public.socket_dir.path)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", test.port), timeout=1)


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, stream) + payload


def request_headers(path: str) -> bytes:
    """A gRPC request's header block in HPACK: :method POST, :scheme http, then literals."""
    def literal(index: int, value: str) -> bytes:
        return bytes([0x40 | index, len(value)]) + value.encode()
    return (b"\x83\x86" + literal(4, path) + literal(1, "x") + literal(31, "application/grpc")
            + b"\x40\x02te\x08trailers")


def watch_request() -> bytes:
    """Stream 1: a whole Health.Watch request (HEADERS, then DATA with END_STREAM)."""
    message = WATCHED.SerializeToString()
    return (frame(1, 0x4, 1, request_headers("/grpc.health.v1.Health/Watch"))
            + frame(0, 0x1, 1, struct.pack(">BI", 0, len(message)) + message))


def test_frame_headers_are_followed_across_any_split():
    data = b"".join([frame(4, 0, 0, b"\0" * 12), frame(1, 4, 1, b"h" * 30),
                     frame(0, 0, 1, b"d" * 100), frame(0, 1, 1, b"d" * 5), frame(6, 0, 0, b"p" * 8),
                     frame(1, 5, 3, b"h" * 3), frame(3, 0, 3, b"\0\0\0\x08"), frame(0, 0, 5)])
    expected = [(1, 4, 1), (0, 1, 1), (1, 5, 3), (3, 0, 3)]
    assert _Frames().scan(data) == expected
    for cut in range(len(data) + 1):
        for second in (cut, min(cut + 7, len(data))):
            frames = _Frames()
            found = frames.scan(data[:cut]) + frames.scan(data[cut:second])
            assert found + frames.scan(data[second:]) == expected, (cut, second)
