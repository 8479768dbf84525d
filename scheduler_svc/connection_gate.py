"""The public gRPC port's gate: an asyncio listener that owns the TCP port and pipes each
connection opening with the HTTP/2 preface to grpc's private unix socket, closing connections
for newcomers at the cap as connection_table chooses. No grpc, no torch.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import shutil
import socket
import struct
import tempfile
import urllib.parse
from dataclasses import dataclass

from scheduler_svc.connection_table import STALL_S, ConnectionTable, ConnState, peer_key
from scheduler_svc.http_protocol import REFUSALS, set_nodelay, throttle_accept_errors

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A gRPC client sends the preface at once, in its first packet, without waiting for the server:
# 5 s still covers that packet lost and resent twice (TCP resends after 1 s, then 3 s).
PREFACE_TIMEOUT_S = 5.0
_KERNEL_BACKLOG = 2048  # a burst of clients waits in the kernel's queue, not refused
_PEER_PREFIX = "pagedserve-gate"  # of the name the gate's unix socket to grpc is bound to

_FRAME_HEAD = struct.Struct(">IBI")  # length (24 bits) and type, flags, stream id
_DATA, _HEADERS, _RST_STREAM = 0, 1, 3
_END_STREAM = 0x1


@dataclass(frozen=True)
class GateLimits:
    """What the public gRPC port holds: `max_connections` admitted, each of which costs three
    descriptors once proven (the client's socket, the gate's to grpc, grpc's accepted one)."""

    max_connections: int = 256
    preface_timeout_s: float = PREFACE_TIMEOUT_S
    accept_batch: int = 16  # connections asyncio accepts at a wakeup, before the cap sees them
    stall_s: float = STALL_S  # a request arriving no faster is as evictable as an idle connection

    def grpc_max_connections(self) -> int:
        """grpc's own cap behind the gate: a connection the gate closed leaves grpc a moment
        later, so grpc may briefly hold some more than the gate counts."""
        return self.max_connections + 2 * self.accept_batch

    def max_descriptors(self) -> int:
        """Three per admitted connection; grpc's share over the gate's count; one for each
        connection accepted in the few loop turns before the cap sees it (as HTTP's), and for
        each closed for a newcomer and not yet gone (two: its socket and the gate's to grpc)."""
        return (3 * self.max_connections + 2 * self.accept_batch + 4 * self.accept_batch
                + 2 * self.accept_batch)


class _Frames:
    """The frame headers of one direction of an HTTP/2 connection, across reads."""

    __slots__ = ("_skip", "_head")

    def __init__(self) -> None:
        self._skip = 0  # payload bytes of the current frame still to come
        self._head = b""  # a frame header cut by the end of the last read

    def scan(self, data: bytes) -> list[tuple[int, int, int]]:
        """(type, flags, stream id) of the frames that may open or end a stream: HEADERS,
        RST_STREAM, and DATA with END_STREAM."""
        if self._head:
            data = self._head + data
        pos, end, found = self._skip, len(data), []
        while pos + 9 <= end:
            length_type, flags, stream = _FRAME_HEAD.unpack_from(data, pos)
            ftype = length_type & 0xFF
            if ftype == _HEADERS or ftype == _RST_STREAM or (
                    ftype == _DATA and flags & _END_STREAM):
                found.append((ftype, flags, stream & 0x7FFFFFFF))
            pos += 9 + (length_type >> 8)
        if pos >= end:
            self._skip, self._head = pos - end, b""
        else:
            self._skip, self._head = 0, data[pos:]
        return found


class _Upstream(asyncio.Protocol):
    """The gate's socket to grpc, one per proven connection."""

    def __init__(self, conn: _GatedConnection) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        self.conn.from_grpc(data)

    def eof_received(self) -> bool:
        return False  # close: both halves go together

    def connection_lost(self, exc) -> None:
        self.conn.upstream_lost()

    def pause_writing(self) -> None:  # grpc reads slower than the client sends
        self.conn.transport.pause_reading()

    def resume_writing(self) -> None:
        self.conn.transport.resume_reading()


class _GatedConnection(asyncio.Protocol):
    """One client connection: held until it proves itself with the preface, then piped to grpc,
    its streams followed from frame headers so that one being answered is evicted only from a
    peer over its share."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.peer = ""  # as grpc writes a peer: ipv4:1.2.3.4:5678
        self._preface = b""
        self._pending: list[bytes] | None = None  # what came while the upstream connects
        self._deadline: asyncio.TimerHandle | None = None
        self._in, self._out = _Frames(), _Frames()
        self._streams: dict[int, bool] = {}  # stream id: its request is whole (being answered)
        self._answering = 0
        self._last_stream = 0

    # --- client side ----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        set_nodelay(transport)
        address = transport.get_extra_info("peername")
        host, port = (address[0], address[1]) if isinstance(address, tuple) else ("", 0)
        self.peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        if self.gate.admit(self, peer_key(host)):
            self._deadline = asyncio.get_running_loop().call_later(
                self.gate.limits.preface_timeout_s, self._on_preface_timeout)

    def data_received(self, data: bytes) -> None:
        if self.upstream is not None:
            self.upstream.write(data)
        elif self._pending is not None:
            self._pending.append(data)
        else:
            data = self._prove(data)
            if not data:
                return
        if self._answering == 0:  # a busy one's client sends pings and window updates on its own
            self.gate.table.touch(self)
        if frames := self._in.scan(data):
            self._client_frames(frames)

    def _prove(self, data: bytes) -> bytes:
        """Checks the preface as it arrives; the bytes after it once it is whole (the upstream
        then connects), else b""."""
        need = len(PREFACE) - len(self._preface)
        self._preface += data[:need]
        if not PREFACE.startswith(self._preface):
            self.gate.refuse(self, "did not open with the HTTP/2 preface")
            return b""
        if len(self._preface) < len(PREFACE):
            self.gate.table.touch(self)
            return b""
        self._disarm()
        rest = data[need:]
        self._pending = [PREFACE, rest]
        self.transport.pause_reading()  # until the upstream is connected
        self.gate.connect_upstream(self)
        return rest

    def _on_preface_timeout(self) -> None:
        self._deadline = None
        self.gate.refuse(self, f"sent no HTTP/2 preface within "
                               f"{self.gate.limits.preface_timeout_s:g}s")

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.gate.forget(self)
        if self.upstream is not None:
            self.upstream.close()

    def pause_writing(self) -> None:  # the client reads slower than grpc sends
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def close(self) -> None:
        """Closes at once: what a client does not read is not worth a descriptor."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()
        if self.upstream is not None:
            self.upstream.abort()

    # --- upstream side --------------------------------------------------------------------------

    def upstream_ready(self, upstream: asyncio.Transport) -> None:
        self.upstream = upstream
        pending, self._pending = self._pending, None
        upstream.write(b"".join(pending))

    def from_grpc(self, data: bytes) -> None:
        self.transport.write(data)
        if frames := self._out.scan(data):
            for ftype, flags, stream in frames:
                if ftype == _RST_STREAM or flags & _END_STREAM:
                    self._end(stream)
            self._restate()

    def upstream_lost(self) -> None:
        """grpc closed the connection (its idle limit, its shutdown): so does the gate."""
        self.upstream = None
        self._streams.clear()
        self._answering = 0
        self._restate()
        self.transport.close()
        if self.transport.get_write_buffer_size():  # a client that never reads its last bytes
            asyncio.get_running_loop().call_later(PREFACE_TIMEOUT_S, self.transport.abort)

    # --- streams --------------------------------------------------------------------------------

    def _client_frames(self, frames: list[tuple[int, int, int]]) -> None:
        streams = self._streams
        for ftype, flags, stream in frames:
            if ftype == _RST_STREAM:
                self._end(stream)
            elif stream > self._last_stream and ftype == _HEADERS:  # a new stream
                self._last_stream = stream
                streams[stream] = bool(flags & _END_STREAM)
                self._answering += streams[stream]
            elif flags & _END_STREAM and streams.get(stream) is False:  # its request is whole
                streams[stream] = True
                self._answering += 1
        self._restate()

    def _end(self, stream: int) -> None:
        self._answering -= self._streams.pop(stream, False)

    def _restate(self) -> None:
        state = (ConnState.BUSY if self._answering else
                 ConnState.READING if self._streams else ConnState.IDLE)
        self.gate.table.set_state(self, state)


class ConnectionGate:
    """Owns the public TCP port; `listen` binds it, `start` serves it once grpc listens on
    `upstream_path`, `close` stops accepting and `close_all` ends what is left."""

    def __init__(self, limits: GateLimits, upstream_path: str) -> None:
        self.limits = limits
        self.upstream_path = upstream_path
        self.table = ConnectionTable(limits.max_connections, limits.stall_s)
        self._sock: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_GatedConnection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._names = itertools.count()

    def listen(self, host: str, port: int) -> int:
        """Binds host:port (0: any free port) without SO_REUSEPORT, so that a second server on
        a busy port fails; returns the port. Raises OSError."""
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()  # as grpc binds [::]
        self._sock = socket.create_server((host, port), family=family, dualstack_ipv6=dualstack)
        return self._sock.getsockname()[1]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        throttle_accept_errors(loop)
        # asyncio accepts up to `backlog` connections at a wakeup and passes it to listen(): a
        # small one bounds the descriptors the cap cannot see yet; the kernel's queue stays large
        self._server = await loop.create_server(lambda: _GatedConnection(self), sock=self._sock,
                                                backlog=self.limits.accept_batch)
        self._sock.listen(_KERNEL_BACKLOG)

    def close(self) -> None:
        """Stops accepting; admitted connections go on until grpc closes them."""
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()

    def close_all(self) -> None:
        for conn in list(self._conns):
            conn.close()

    @property
    def num_connections(self) -> int:
        return len(self.table)

    # --- what connections ask of the gate -------------------------------------------------------

    def admit(self, conn: _GatedConnection, peer: str) -> bool:
        """Counts a new connection, closing one for it at the cap (connection_table's choice: an
        idle one, else one of a peer over its share, its calls then ending UNAVAILABLE at the
        client); when none may go, closes the newcomer instead (False)."""
        if self.table.full():
            victim = self.table.victim(peer)
            if victim is None:
                REFUSALS.warning("grpc-connections", f"gRPC API: closed new connections over "
                                 f"the cap of {self.limits.max_connections}, all busy and none "
                                 "of a peer over its share (--grpc-max-connections)")
                conn.transport.close()
                return False
            if self.table.state(victim) is ConnState.BUSY:
                REFUSALS.warning("grpc-evicted-busy", f"gRPC API: at the cap of "
                                 f"{self.limits.max_connections} connections, closed ones with "
                                 "calls in progress of peers holding more than their share for "
                                 "newcomers of other peers")
            else:
                REFUSALS.warning("grpc-evicted", f"gRPC API: at the cap of "
                                 f"{self.limits.max_connections} connections, closed idle ones "
                                 "of the peers holding the most for newcomers")
            self.table.remove(victim)
            victim.close()
        self.table.add(conn, peer)
        self._conns.add(conn)
        return True

    def refuse(self, conn: _GatedConnection, reason: str) -> None:
        REFUSALS.warning("grpc-preface", f"gRPC API: closed connections that {reason}")
        self.table.remove(conn)
        conn.close()

    def forget(self, conn: _GatedConnection) -> None:
        self.table.remove(conn)
        self._conns.discard(conn)

    def connect_upstream(self, conn: _GatedConnection) -> None:
        task = asyncio.get_running_loop().create_task(self._connect(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: _GatedConnection) -> None:
        """Opens the gate's socket to grpc, bound to a name that carries the client's address,
        so that grpc's context.peer() still names the client."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            try:
                sock.bind(f"\0{_PEER_PREFIX}/{os.getpid()}/{next(self._names)}/{conn.peer}")
            except OSError:  # no abstract names here: grpc sees an unnamed peer
                pass
            await loop.sock_connect(sock, self.upstream_path)
            upstream, _ = await loop.create_unix_connection(lambda: _Upstream(conn), sock=sock)
        except OSError as err:
            sock.close()
            REFUSALS.warning("grpc-upstream", f"gRPC API: cannot reach the gRPC server: {err}")
            conn.close()
            return
        if conn.transport.is_closing():
            upstream.abort()
            return
        conn.upstream_ready(upstream)
        conn.transport.resume_reading()


def client_peer(peer: str) -> str:
    """The client's address in a peer grpc reports behind the gate (as grpc writes one)."""
    prefix = f"unix-abstract:{_PEER_PREFIX}/"
    if peer.startswith(prefix) and peer.count("/") >= 3:
        return urllib.parse.unquote(peer[len(prefix):].split("/", 2)[2])  # grpc escapes some
    return peer


class PrivateSocketDir:
    """A directory only this user can enter (mode 0700), holding grpc's unix socket: no other
    local user reaches grpc behind the gate. Removed by `remove`, or at exit."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="pagedserve-")
        if len(self.path) > 90:  # a unix socket's path is at most 107 bytes
            os.rmdir(self.path)
            self.path = tempfile.mkdtemp(prefix="pagedserve-", dir="/tmp")
        self.socket_path = os.path.join(self.path, "grpc.sock")
        atexit.register(self.remove)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.remove)
