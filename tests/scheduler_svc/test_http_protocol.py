"""The HTTP API's connection bounds in-process, on a real uvicorn listener over raw sockets: the
connection cap's 429, header size and count limits, the header, body and keep-alive deadlines,
and the throttled log of refusals and accept errors. Against real processes, with bystanders:
tests/integration/test_http_bounds.py."""
import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from scheduler_svc.http_protocol import HttpLimits, ThrottledLog, throttle_accept_errors
from scheduler_svc.openai_server import OpenAIConfig, OpenAIServer

LIMITS = HttpLimits(max_connections=2, header_timeout_s=0.3, body_timeout_s=0.3,
                    keep_alive_timeout_s=0.3)
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n"


class AttachedEngine:
    """What /health asks of the engine."""

    attached, draining = True, False


def run(test, limits: HttpLimits = LIMITS):
    async def main():
        server = OpenAIServer(AttachedEngine(), OpenAIConfig(limits=limits), CollectorRegistry())
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


def test_connections_over_the_cap_get_429_with_retry_after():
    async def test(port):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reply = await exchange(port, HEALTH + b"\r\n")
        assert reply.startswith(b"HTTP/1.1 429 ") and b"\r\nretry-after: 1\r\n" in reply
        assert b'"type": "rate_limit_error"' in reply
        held[0][1].close()
        await asyncio.sleep(0.05)
        assert (await exchange(port, HEALTH + b"connection: close\r\n\r\n")).startswith(
            b"HTTP/1.1 200 ")
        held[1][1].close()
    run(test)


def test_over_the_refusal_room_a_connection_is_closed_unanswered():
    async def test(port):
        held = [await asyncio.open_connection("127.0.0.1", port)
                for _ in range(LIMITS.max_open())]
        assert await exchange(port, HEALTH + b"\r\n") == b""
        for _, writer in held:
            writer.close()
    run(test, HttpLimits(max_connections=2, header_timeout_s=5))


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
