"""The HTTP API's connection bounds: uvicorn's httptools protocol with header size and count
limits, header, body and keep-alive deadlines, a connection cap (idle connections, or those of a
peer over its share, closed for newcomers, else 429), and the throttled log of refusals and accept
errors. Knows nothing of the API's routes. No gRPC, no torch.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
import weakref
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from scheduler_svc.connection_table import STALL_S, ConnectionTable, ConnState, peer_key

log = logging.getLogger(__name__)

# Connections over the cap are answered 429 while at most this share more are open: the answer and
# its short linger hold a descriptor each; beyond it a connection is closed unanswered.
_REFUSAL_ROOM = 8  # 1/8 of the cap, plus _MIN_REFUSAL_ROOM
_MIN_REFUSAL_ROOM = 16
_LINGER_S = 1.0  # a refused connection reads (and drops) what its client still sends this long
# before it closes: a close with unread data resets the connection, and the client would see the
# reset rather than the answer
_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold. `max_header_bytes` counts the request line and every
    header line; past it or `max_headers` the answer is 431."""

    max_connections: int = 512
    max_header_bytes: int = 64 * 1024
    max_headers: int = 256  # vLLM's h11 header count limit
    header_timeout_s: float = 10.0  # from the connection's (or request's) first byte
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body
    keep_alive_timeout_s: float = 5.0  # vLLM's: idle between two requests
    stall_s: float = STALL_S  # a request arriving no faster is as evictable as an idle connection
    # Connections asyncio accepts at a wakeup, before any of them is counted against the cap.
    accept_batch: int = 256

    def max_open(self) -> int:
        """Connections open at most: the cap and the refused ones lingering."""
        return self.max_connections + self.max_connections // _REFUSAL_ROOM + _MIN_REFUSAL_ROOM

    def max_descriptors(self) -> int:
        """Descriptors the HTTP API holds at most: `max_open`, the connections accepted in the
        few loop turns before the cap sees (and closes) them, and those closed for newcomers,
        gone a loop turn later."""
        return self.max_open() + 5 * self.accept_batch


class ThrottledLog:
    """A warning per kind at most every `interval_s`, saying how often it happened since: an
    attacker who repeats a refused request cannot grow the log faster than that. What a burst
    held back is reported when its interval ends, not only when a later one comes."""

    def __init__(self, interval_s: float = _LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._messages: dict[str, str] = {}
        self._flush_due: dict[str, asyncio.AbstractEventLoop] = {}  # kind: loop of its flush

    def warning(self, kind: str, message: str) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._messages[kind] = message
        now = time.monotonic()
        due = self._last.get(kind, -math.inf) + self.interval_s
        if now >= due:
            self._emit(kind, now)
        elif kind not in self._flush_due or self._flush_due[kind].is_closed():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop: the next warning reports it
                return
            loop.call_later(due - now, self._flush, kind)
            self._flush_due[kind] = loop

    def _flush(self, kind: str) -> None:
        self._flush_due.pop(kind, None)
        if self._counts.get(kind):
            self._emit(kind, time.monotonic())

    def _emit(self, kind: str, now: float) -> None:
        count = self._counts.pop(kind)
        self._last[kind] = now
        log.warning("%s (%d time%s in the last %gs)", self._messages[kind], count,
                    "" if count == 1 else "s", self.interval_s)


REFUSALS = ThrottledLog()


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Nagle's algorithm off on an accepted TCP connection: else a stream's small chunks wait for
    the client's delayed ACK (~40 ms) once the connection has carried a response. asyncio turns it
    off itself only on sockets whose protocol number is IPPROTO_TCP; socket.create_server's is 0."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def throttle_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs every failed accept (EMFILE: out of descriptors) with a traceback, and retries
    each second per listener; those go to the throttled log instead, without the traceback."""
    def handle(loop, context) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            REFUSALS.warning("accept", f"cannot accept connections: "
                                       f"{context.get('exception')}")
        else:
            loop.default_exception_handler(context)
    loop.set_exception_handler(handle)


class _Refusal(Exception):
    """Raised in a parser callback to stop parsing and answer `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def error_response(status: int, message: str, extra_headers: tuple[tuple[str, str], ...] = ()
                   ) -> bytes:
    """A whole response in OpenAI's error shape that closes the connection."""
    type_ = "rate_limit_error" if status == 429 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": None}}).encode()
    head = [STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    head += [f"{name}: {value}\r\n".encode("latin-1") for name, value in extra_headers]
    return b"".join([*head, b"\r\n", body])


# uvicorn's state shared by one server's connections: the table of those the cap admitted
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _table_of(server_state, limits: HttpLimits) -> ConnectionTable:
    table = _TABLES.get(server_state)
    if table is None:
        table = _TABLES[server_state] = ConnectionTable(limits.max_connections, limits.stall_s)
    return table


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded. uvicorn itself has no header limit with httptools
    (which grows a header by concatenation: quadratic time on the shared event loop), no deadline
    before a request's headers or body end, and no connection cap before descriptors run out."""

    def __init__(self, *args, limits: HttpLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._table = _table_of(self.server_state, limits)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_headers = True  # until this request's headers end
        self._header_bytes = 0
        self._refused = False

    # --- connection -----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        set_nodelay(transport)
        peer = peer_key(self.client[0] if self.client else None)
        if self._table.full() and not self._evict_for_newcomer(peer):
            self._refuse_connection()
            return
        self._table.add(self, peer)
        self._arm(self.limits.header_timeout_s, self._on_header_timeout)

    def _evict_for_newcomer(self, peer: str) -> bool:
        """Closes connection_table's choice for a newcomer from `peer`: an idle connection of the
        most crowded peer, else one of a peer over its share, busy or not. False if none may go."""
        victim = self._table.victim(peer)
        if victim is None:
            return False
        if self._table.state(victim) is ConnState.BUSY:
            REFUSALS.warning("evicted-busy", f"HTTP API: at the cap of "
                             f"{self.limits.max_connections} connections, cut requests of peers "
                             "holding more than their share for newcomers of other peers")
        else:
            REFUSALS.warning("evicted", f"HTTP API: at the cap of {self.limits.max_connections} "
                                        "connections, closed idle ones of the peers holding the "
                                        "most for newcomers")
        self._table.remove(victim)
        victim._evict()
        return True

    def _evict(self) -> None:
        """Closes the connection, as its keep-alive timeout would (at once if its client does
        not read what it was sent); a request being answered sees its client gone, as after a
        disconnect, and is aborted."""
        self._refused = True
        self._disarm()
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def _restate(self) -> None:
        """Idle (nothing asked), reading a request, or answering one (cut only over its share)."""
        cycle = self.cycle
        if self.pipeline or cycle is not None and not cycle.response_complete and (
                not cycle.more_body or cycle.response_started):
            state = ConnState.BUSY
        elif self._header_bytes or cycle is not None and not cycle.response_complete:
            state = ConnState.READING
        else:
            state = ConnState.IDLE
        self._table.set_state(self, state)

    def _refuse_connection(self) -> None:
        """429 with Retry-After, then the linger; closed unanswered past the refusal room."""
        cap = self.limits.max_connections
        REFUSALS.warning("connections", f"HTTP API: refused connections over the cap of {cap} "
                                        "(--http-max-connections)")
        if len(self.connections) > self.limits.max_open():
            self._refused = True
            self.transport.close()
            return
        self._answer_and_linger(error_response(
            429, f"too many connections to this server (at most {cap}); retry shortly",
            (("retry-after", "1"),)))

    def _answer_and_linger(self, response: bytes) -> None:
        self._refused = True
        self._disarm()
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(_LINGER_S, self.transport.close)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._table.remove(self)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._restate()

    # --- reading --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        if self._reading_headers and self._deadline is None and not self._responding():
            self._arm(self.limits.header_timeout_s, self._on_header_timeout)
        while data and not self._refused and not self.transport.is_closing():
            piece, data = data, b""
            if self._reading_headers:  # the parser never sees more header bytes than the limit
                room = self.limits.max_header_bytes - self._header_bytes
                if room <= 0:
                    self._refuse(431, f"the request line and headers are over "
                                      f"{self.limits.max_header_bytes} bytes")
                    return
                piece, data = piece[:room], piece[room:]
                self._header_bytes += len(piece)
            if not self._feed(piece):
                return
        self._restate()
        self._table.touch(self)

    def _feed(self, data: bytes) -> bool:
        """Parses `data`; False once the connection is answered and closing."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:  # a callback's refusal, or a malformed request
            refusal = err.__context__
            if isinstance(refusal, _Refusal):
                self._refuse(refusal.status, refusal.message)
            else:
                self._refuse(400, "invalid HTTP request")
            return False
        except httptools.HttpParserUpgrade:
            pass  # no WebSocket route: the request was dispatched as plain HTTP
        return True

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            raise _Refusal(431, f"more than {self.limits.max_headers} request headers")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._disarm()
        self._arm(self.limits.body_timeout_s, self._on_body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._reading_headers, self._header_bytes = True, 0
        super().on_message_complete()

    # --- deadlines ------------------------------------------------------------------------------

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self, delay_s: float, callback) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_header_timeout(self) -> None:
        self._deadline = None
        if self._header_bytes == 0:  # nothing of a request came: an idle connection
            self.transport.close()
        else:
            self._refuse(408, f"the request headers did not arrive within "
                              f"{self.limits.header_timeout_s:g}s")

    def _on_body_timeout(self) -> None:
        self._deadline = None
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
        else:
            self._refuse(408, f"the request body did not arrive within "
                              f"{self.limits.body_timeout_s:g}s")

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` (unless a response has started) and closes; the request, if one is
        being served, sees its client gone."""
        REFUSALS.warning(str(status), f"HTTP API: answered {status}: {message}")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's own answer is dropped from here on
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        self._answer_and_linger(error_response(status, message))
