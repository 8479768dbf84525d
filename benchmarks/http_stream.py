"""A small HTTP/1.1 client on asyncio streams for the online benchmark: a POST whose response body
arrives piece by piece, each with the time it was read, over keep-alive connections, and a GET of
JSON. httpx could not keep up with hundreds of streams at once (RESULTS.md, online benchmark).
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass

READ_SIZE = 1 << 16
MAX_ERROR_BODY = 1 << 16  # of a refusal's body kept for its message


class HttpStatusError(Exception):
    """A response other than 200: its status and (the start of) its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


@dataclass(frozen=True)
class Endpoint:
    """Where a base URL points: host, port, TLS, and the path prefix before /v1/..."""

    host: str
    port: int
    tls: bool
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls,
                   parts.path.rstrip("/"))


class Connections:
    """Keep-alive connections to one endpoint, reused as vLLM's benchmark client (aiohttp)
    reuses them: a response read to its end gives its connection back, unless the server
    closes it."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """An idle connection (reused: True) or a new one."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
            writer.close()
        return (*await _open(self.endpoint), False)

    def give_back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._idle.append((reader, writer))

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def post_stream(connections: Connections, path: str, payload: dict,
                      headers: dict[str, str] | None = None
                      ) -> AsyncIterator[tuple[float, bytes]]:
    """POSTs `payload` as JSON; yields (perf_counter when read, body bytes) as they arrive.
    Raises HttpStatusError for a status other than 200. A reused connection the server had
    closed is replaced once, before anything came back."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    request = _request("POST", connections.endpoint, path, headers, body, keep_alive=True)
    for attempt in (1, 2):
        reader, writer, reused = await connections.take()
        done = False
        try:
            writer.write(request)
            try:
                status, response_headers = await _read_head(reader)
            except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as err:
                if reused and attempt == 1 and not getattr(err, "partial", b""):
                    continue  # closed while idle (its keep-alive timeout): nothing came back
                raise
            pieces = _body(reader, response_headers)
            if status != 200:
                raise HttpStatusError(status, await _collect(pieces, MAX_ERROR_BODY))
            async for piece in pieces:
                yield piece
            done = "close" not in response_headers.get("connection", "").lower() \
                and _delimited(response_headers)
            return
        finally:
            if done:
                connections.give_back(reader, writer)
            else:
                writer.close()


def _delimited(headers: dict[str, str]) -> bool:
    """Whether the body's end is known without the connection closing."""
    return "content-length" in headers or "chunked" in headers.get("transfer-encoding", "")


async def get_json(endpoint: Endpoint, path: str, headers: dict[str, str] | None = None):
    """GETs `path` and parses its JSON body; HttpStatusError for a status other than 200."""
    reader, writer = await _open(endpoint)
    try:
        writer.write(_request("GET", endpoint, path, headers, b""))
        status, response_headers = await _read_head(reader)
        body = await _collect(_body(reader, response_headers), MAX_ERROR_BODY)
        if status != 200:
            raise HttpStatusError(status, body)
        return json.loads(body)
    finally:
        writer.close()


async def _open(endpoint: Endpoint):
    context = ssl.create_default_context() if endpoint.tls else None
    return await asyncio.open_connection(endpoint.host, endpoint.port, ssl=context,
                                         limit=READ_SIZE)


def _request(method: str, endpoint: Endpoint, path: str, headers: dict[str, str] | None,
             body: bytes, keep_alive: bool = False) -> bytes:
    lines = [f"{method} {endpoint.prefix}{path} HTTP/1.1", f"Host: {endpoint.host}",
             f"Connection: {'keep-alive' if keep_alive else 'close'}", "Accept: */*",
             f"Content-Length: {len(body)}"]
    if body:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and the headers (names lower-cased); the body stays unread."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP response: {status_line[:100]!r}")
    headers = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]
                ) -> AsyncIterator[tuple[float, bytes]]:
    """The body's bytes as read: chunked, of a Content-Length, or up to the connection's end."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        async for piece in _chunked(reader):
            yield piece
        return
    left = int(headers["content-length"]) if "content-length" in headers else None
    while left is None or left > 0:
        data = await reader.read(READ_SIZE if left is None else min(left, READ_SIZE))
        if not data:
            if left:
                raise ConnectionError(f"the connection closed {left} bytes short of the body")
            return
        if left is not None:
            left -= len(data)
        yield time.perf_counter(), data


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[tuple[float, bytes]]:
    """Decodes chunked transfer coding, yielding each read's whole chunk data at once (the
    chunks a read brings in share its time)."""
    buffer = b""
    while True:
        data = await reader.read(READ_SIZE)
        if not data:
            raise ConnectionError("the connection closed inside a chunked body")
        now = time.perf_counter()
        buffer += data
        out, buffer, done = _take_chunks(buffer)
        if out:
            yield now, out
        if done:
            return


def _take_chunks(buffer: bytes) -> tuple[bytes, bytes, bool]:
    """The data of the whole chunks at the start of `buffer`, what is left, and whether the
    body ended (its last, empty chunk and the line after it were among them)."""
    out, pos = [], 0
    while True:
        end = buffer.find(b"\r\n", pos)
        if end < 0:
            return b"".join(out), buffer[pos:], False
        size_text = buffer[pos:end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ConnectionError(f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:  # the last chunk: done at the empty line after any trailers
            tail = buffer.find(b"\r\n\r\n", end)
            if tail < 0:
                return b"".join(out), buffer[pos:], False
            return b"".join(out), buffer[tail + 4:], True
        if len(buffer) < end + 2 + size + 2:
            return b"".join(out), buffer[pos:], False
        out.append(buffer[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


async def _collect(pieces: AsyncIterator[tuple[float, bytes]], limit: int) -> bytes:
    body = b""
    async for _, data in pieces:
        body += data
        if len(body) >= limit:
            break
    return body[:limit]
