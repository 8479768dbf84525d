"""Which connection a full listener closes for a newcomer: per-peer eviction of idle connections,
shared by the HTTP API and the gRPC gate. Knows connections only as keys; no asyncio, no gRPC.
"""
from __future__ import annotations

import enum
import ipaddress
import time
from collections.abc import Callable, Hashable

# A request that stopped arriving this long ago is stuck, and as evictable as an idle connection:
# a working client sends a request's bytes back to back.
STALL_S = 1.0


class ConnState(enum.Enum):
    IDLE = "idle"  # nothing asked: before its first byte, between requests, or gRPC with no stream
    READING = "reading"  # a request is arriving; evictable once stalled STALL_S
    BUSY = "busy"  # a request is being answered: never evicted


def peer_key(host: str | None) -> str:
    """Who holds a connection: its IPv4 address, or its IPv6 /64 (one host's usual share, which
    it can fill with addresses at will); other names as they are."""
    try:
        ip = ipaddress.ip_address((host or "").split("%")[0])
    except ValueError:
        return host or ""
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Peer:
    __slots__ = ("key", "count", "idle", "reading")

    def __init__(self, key: str) -> None:
        self.key = key
        self.count = 0  # open connections, busy ones too
        # connection: when last active, least recently active first (dicts keep insertion order)
        self.idle: dict[Hashable, float] = {}
        self.reading: dict[Hashable, float] = {}

    def candidate(self) -> bool:
        return bool(self.idle or self.reading)

    def pick(self, now: float, stall_s: float) -> Hashable | None:
        """The least recently active of its idle connections and its stalled readers (the
        first reader is its least recently active: if it is not stalled, none is)."""
        best = next(iter(self.idle.items())) if self.idle else None
        if self.reading:
            conn, at = next(iter(self.reading.items()))
            if at <= now - stall_s and (best is None or at < best[1]):
                best = (conn, at)
        return best[0] if best else None


class ConnectionTable:
    """The connections one listener admitted, by peer and state. At the cap, `victim` names the
    connection to close: of the peer holding the most connections (busy ones counted), its least
    recently active one that is idle or stalled; None while every connection is busy or reading."""

    def __init__(self, max_connections: int, stall_s: float = STALL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.stall_s = stall_s
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self._conns: dict[Hashable, tuple[_Peer, ConnState]] = {}
        self._buckets: dict[int, dict[_Peer, None]] = {}  # count: peers with a candidate
        self._top = 0  # no bucket above it holds a peer

    def __len__(self) -> int:
        return len(self._conns)

    def __contains__(self, conn: Hashable) -> bool:
        return conn in self._conns

    def full(self) -> bool:
        return len(self._conns) >= self.max_connections

    def state(self, conn: Hashable) -> ConnState | None:
        entry = self._conns.get(conn)
        return entry[1] if entry else None

    def add(self, conn: Hashable, peer: str) -> None:
        """A new connection, idle until its first request."""
        p = self._peers.get(peer) or self._peers.setdefault(peer, _Peer(peer))
        self._unfile(p)
        p.count += 1
        p.idle[conn] = self.clock()
        self._conns[conn] = (p, ConnState.IDLE)
        self._file(p)

    def remove(self, conn: Hashable) -> None:
        entry = self._conns.pop(conn, None)
        if entry is None:
            return
        p = entry[0]
        self._unfile(p)
        p.count -= 1
        p.idle.pop(conn, None)
        p.reading.pop(conn, None)
        if p.count:
            self._file(p)
        else:
            del self._peers[p.key]

    def set_state(self, conn: Hashable, state: ConnState) -> None:
        entry = self._conns.get(conn)
        if entry is None or entry[1] is state:
            return
        p = entry[0]
        self._unfile(p)
        p.idle.pop(conn, None)
        p.reading.pop(conn, None)
        if state is not ConnState.BUSY:
            (p.idle if state is ConnState.IDLE else p.reading)[conn] = self.clock()
        self._conns[conn] = (p, state)
        self._file(p)

    def touch(self, conn: Hashable) -> None:
        """The connection's client sent something: it becomes its peer's most recently active."""
        entry = self._conns.get(conn)
        if entry is None or entry[1] is ConnState.BUSY:
            return
        conns = entry[0].idle if entry[1] is ConnState.IDLE else entry[0].reading
        del conns[conn]
        conns[conn] = self.clock()

    def victim(self) -> Hashable | None:
        now = self.clock()
        count = self._top
        while count > 0:
            bucket = self._buckets.get(count)
            if not bucket and count == self._top:
                self._top -= 1  # nothing above it any more
            for p in bucket or ():
                conn = p.pick(now, self.stall_s)
                if conn is not None:
                    return conn
            count -= 1
        return None

    def _unfile(self, p: _Peer) -> None:
        bucket = self._buckets.get(p.count)
        if bucket is not None and p in bucket:
            del bucket[p]
            if not bucket:
                del self._buckets[p.count]

    def _file(self, p: _Peer) -> None:
        if p.candidate():
            self._buckets.setdefault(p.count, {})[p] = None
            self._top = max(self._top, p.count)
