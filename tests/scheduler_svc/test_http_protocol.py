"""The HTTP API's connection bounds in-process, on a real uvicorn listener over raw sockets: the
connection cap (idle connections closed for newcomers, else 429), header size and count limits,
the header, body and keep-alive deadlines, and the throttled log of refusals and accept errors.
Against real processes, with bystanders: tests/integration/test_http_bounds.py."""
import asyncio
import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.http_protocol import HttpLimits, ThrottledLog, throttle_accept_errors
from scheduler_svc.openai_server import OpenAIConfig, OpenAIServer

LIMITS = HttpLimits(max_connections=2, header_timeout_s=0.3, body_timeout_s=0.3,
                    keep_alive_timeout_s=0.3)
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n"


class AttachedEngine:
    """What /health asks of the engine."""

    attached, draining = True, False
    config = EngineConfig()


SLOW = asyncio.Event()


async def slow(request):
    """An answer that takes until the test releases it."""
    await SLOW.wait()
    return PlainTextResponse("done")


def run(test, limits: HttpLimits = LIMITS, slow_route: bool = False):
    async def main():
        global SLOW
        SLOW = asyncio.Event()
        server = OpenAIServer(AttachedEngine(), OpenAIConfig(limits=limits), CollectorRegistry())
        if slow_route:
            server.app.router.routes.append(Route("/slow", slow))
        port = await server.start("127.0.0.1", 0)
        try:
            await asyncio.wait_for(test(port), 30)
        finally:
            await server.stop()
    asyncio.run(main())


async def exchange(port: int, data: bytes = b"", timeout: float = 5.0) -> bytes:
    """Sends `data`, then reads until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def reading(port: int, host: str = "127.0.0.1"):
    """A connection whose request is arriving (not evictable before it stalls)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    writer.write(b"GET /hea")
    await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 2.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), timeout) == b""
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_connections_over_the_cap_get_429_with_retry_after():
    async def test(port):
        held = [await reading(port) for _ in range(2)]
        reply = await exchange(port, HEALTH + b"\r\n")
        assert reply.startswith(b"HTTP/1.1 429 ") and b"\r\nretry-after: 1\r\n" in reply
        assert b'"type": "rate_limit_error"' in reply
        held[0][1].close()
        await asyncio.sleep(0.05)
        assert (await exchange(port, HEALTH + b"connection: close\r\n\r\n")).startswith(
            b"HTTP/1.1 200 ")
        held[1][1].close()
    run(test, dataclasses.replace(LIMITS, header_timeout_s=5, stall_s=30))


def test_over_the_refusal_room_a_connection_is_closed_unanswered():
    async def test(port):
        held = [await reading(port) for _ in range(LIMITS.max_open())]
        assert await exchange(port, HEALTH + b"\r\n") == b""
        for _, writer in held:
            writer.close()
    run(test, HttpLimits(max_connections=2, header_timeout_s=5, stall_s=30))


def test_at_the_cap_an_idle_connection_of_the_most_crowded_peer_makes_room():
    """127.0.0.2 holds two connections (one idle, one reading), 127.0.0.3 one, idle longer: a
    newcomer takes the place of 127.0.0.2's idle one, each time."""
    async def test(port):
        lone = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
        crowded_reading = await reading(port, "127.0.0.2")
        for _ in range(2):
            crowded = await asyncio.open_connection("127.0.0.1", port,
                                                    local_addr=("127.0.0.2", 0))
            await asyncio.sleep(0.05)
            assert (await exchange(port, HEALTH + b"connection: close\r\n\r\n")).startswith(
                b"HTTP/1.1 200 ")
            assert await closed_by_server(crowded[0])
        assert not await closed_by_server(lone[0], timeout=0.1)
        crowded_reading[1].write(b"lth HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert (await crowded_reading[0].read()).startswith(b"HTTP/1.1 200 ")  # untouched
    run(test, HttpLimits(max_connections=3, header_timeout_s=5, stall_s=30))


def test_a_kept_alive_connection_makes_room_and_one_being_answered_never_does():
    """A connection idle after its answer is closed for a newcomer; one whose request is whole
    and being answered is not, however long ago it spoke: the newcomer gets 429."""
    async def test(port):
        kept = await asyncio.open_connection("127.0.0.1", port)
        kept[1].write(HEALTH + b"\r\n")
        assert (await kept[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        answering = [await asyncio.open_connection("127.0.0.1", port)]
        answering[0][1].write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        assert (await exchange(port, HEALTH + b"connection: close\r\n\r\n")).startswith(
            b"HTTP/1.1 200 ")
        assert await closed_by_server(kept[0])
        answering.append(await asyncio.open_connection("127.0.0.1", port))
        answering[1][1].write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        refused = await exchange(port, HEALTH + b"connection: close\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 429 ")
        SLOW.set()
        for reader, _ in answering:
            assert (await reader.readuntil(b"done")).startswith(b"HTTP/1.1 200 ")
    run(test, HttpLimits(max_connections=2, header_timeout_s=5, keep_alive_timeout_s=5,
                         stall_s=0.01), slow_route=True)


@pytest.mark.parametrize("headers,status", [  # host and connection are two more headers
    (b"x-big: " + b"a" * (64 << 10) + b"\r\n", 431), (b"x-a: b\r\n" * 255, 431),
    (b"x-a: b\r\n" * 254, 200), (b"x-big: " + b"a" * (60 << 10) + b"\r\n", 200)])
def test_header_size_and_count_limits(headers, status):
    async def test(port):
        reply = await exchange(port, HEALTH + headers + b"connection: close\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:100]
    run(test, HttpLimits(max_connections=8))


def test_header_body_and_keep_alive_deadlines():
    async def test(port):
        started = asyncio.get_running_loop().time()
        idle, slow, body, kept = await asyncio.gather(
            exchange(port), exchange(port, HEALTH),
            exchange(port, b"POST /v1/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
                           b"content-length: 100\r\n\r\n{"),
            exchange(port, HEALTH + b"\r\n"))
        assert asyncio.get_running_loop().time() - started < 2
        assert idle == b""
        assert slow.startswith(b"HTTP/1.1 408 ") and b"headers did not arrive" in slow
        assert body.startswith(b"HTTP/1.1 408 ") and b"body did not arrive" in body
        assert kept.startswith(b"HTTP/1.1 200 ") and kept.count(b"HTTP/1.1") == 1
    run(test, HttpLimits(max_connections=8, header_timeout_s=0.3, body_timeout_s=0.3,
                         keep_alive_timeout_s=0.3))


def test_refusals_are_logged_once_per_interval(caplog):
    throttled = ThrottledLog(interval_s=60)
    with caplog.at_level(logging.WARNING, "scheduler_svc.http_protocol"):
        for _ in range(100):
            throttled.warning("431", "answered 431")
        throttled.warning("408", "answered 408")
    assert [r.getMessage() for r in caplog.records] == [
        "answered 431 (1 time in the last 60s)", "answered 408 (1 time in the last 60s)"]


def test_what_a_burst_held_back_is_logged_when_its_interval_ends(caplog):
    throttled = ThrottledLog(interval_s=0.2)

    async def burst():
        for _ in range(100):
            throttled.warning("429", "answered 429")
        await asyncio.sleep(0.4)
    with caplog.at_level(logging.WARNING, "scheduler_svc.http_protocol"):
        asyncio.run(burst())
    assert [r.getMessage() for r in caplog.records] == [
        "answered 429 (1 time in the last 0.2s)", "answered 429 (99 times in the last 0.2s)"]


def test_accept_errors_are_logged_without_tracebacks_once_per_interval(caplog):
    """asyncio reports every failed accept (EMFILE) through the loop's exception handler."""
    async def main():
        loop = asyncio.get_running_loop()
        throttle_accept_errors(loop)
        for _ in range(50):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(24, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})
    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    accept = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(accept) == 1 and accept[0].exc_info is None
    assert "Too many open files" in accept[0].getMessage()
    assert any(r.getMessage() == "something else" for r in caplog.records)
