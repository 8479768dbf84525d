"""Which connection a full listener closes for a newcomer: an idle one of the most crowded peer,
else a busy one of a peer holding more than its share; shared by the HTTP API and the gRPC gate.
Knows connections only as keys; no asyncio, no gRPC.
"""
from __future__ import annotations

import enum
import ipaddress
import time
from collections.abc import Callable, Hashable, Iterator

# A request that stopped arriving this long ago is stuck, and as evictable as an idle connection:
# a working client sends a request's bytes back to back.
STALL_S = 1.0


class ConnState(enum.Enum):
    IDLE = "idle"  # nothing asked: before its first byte, between requests, or gRPC with no stream
    READING = "reading"  # a request is arriving; evictable once stalled STALL_S
    BUSY = "busy"  # a request is being answered: evicted only from a peer over its share


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
    __slots__ = ("key", "count", "idle", "reading", "busy")

    def __init__(self, key: str) -> None:
        self.key = key
        self.count = 0  # open connections, busy ones too
        # connection: when last active, least recently active first (dicts keep insertion order)
        self.idle: dict[Hashable, float] = {}
        self.reading: dict[Hashable, float] = {}
        self.busy: dict[Hashable, float] = {}

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

    def least_recently_active(self) -> Hashable | None:
        """Of all its connections, whatever their state."""
        heads = [next(iter(conns.items())) for conns in (self.idle, self.reading, self.busy)
                 if conns]
        return min(heads, key=lambda head: head[1])[0] if heads else None

    def conns_of(self, state: ConnState) -> dict[Hashable, float]:
        return (self.idle if state is ConnState.IDLE else
                self.reading if state is ConnState.READING else self.busy)


class _ByCount:
    """Peers filed by the connections they hold; `unfile` before a peer's count changes,
    `file` after."""

    def __init__(self) -> None:
        self._buckets: dict[int, dict[_Peer, None]] = {}
        self._top = 0  # no bucket above it holds a peer

    def file(self, p: _Peer) -> None:
        self._buckets.setdefault(p.count, {})[p] = None
        self._top = max(self._top, p.count)

    def unfile(self, p: _Peer) -> None:
        bucket = self._buckets.get(p.count)
        if bucket is not None and p in bucket:
            del bucket[p]
            if not bucket:
                del self._buckets[p.count]

    def most_first(self) -> Iterator[_Peer]:
        count = self._top
        while count > 0:
            bucket = self._buckets.get(count)
            if not bucket and count == self._top:
                self._top -= 1  # nothing above it any more
            yield from bucket or ()
            count -= 1


class ConnectionTable:
    """The connections one listener admitted, by peer and state. At the cap, `victim` names the
    connection to close for a newcomer: of the peer holding the most connections (busy ones
    counted) among those holding at least as many as the newcomer's, its least recently active
    one that is idle or stalled; while none is, the least recently active connection of the most
    crowded peer if it is over its share (`over_share`); else None."""

    def __init__(self, max_connections: int, stall_s: float = STALL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.stall_s = stall_s
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self._conns: dict[Hashable, tuple[_Peer, ConnState]] = {}
        self._candidates = _ByCount()  # peers with an idle or reading connection
        self._crowds = _ByCount()  # every peer

    def __len__(self) -> int:
        return len(self._conns)

    def __contains__(self, conn: Hashable) -> bool:
        return conn in self._conns

    def full(self) -> bool:
        return len(self._conns) >= self.max_connections

    def state(self, conn: Hashable) -> ConnState | None:
        entry = self._conns.get(conn)
        return entry[1] if entry else None

    def held_by(self, peer: str | None) -> int:
        p = self._peers.get(peer) if peer is not None else None
        return p.count if p else 0

    def add(self, conn: Hashable, peer: str) -> None:
        """A new connection, idle until its first request."""
        p = self._peers.get(peer) or self._peers.setdefault(peer, _Peer(peer))
        self._unfile(p, counted=True)
        p.count += 1
        p.idle[conn] = self.clock()
        self._conns[conn] = (p, ConnState.IDLE)
        self._file(p, counted=True)

    def remove(self, conn: Hashable) -> None:
        entry = self._conns.pop(conn, None)
        if entry is None:
            return
        p = entry[0]
        self._unfile(p, counted=True)
        p.count -= 1
        del p.conns_of(entry[1])[conn]
        if p.count:
            self._file(p, counted=True)
        else:
            del self._peers[p.key]

    def set_state(self, conn: Hashable, state: ConnState) -> None:
        entry = self._conns.get(conn)
        if entry is None or entry[1] is state:
            return
        p = entry[0]
        self._unfile(p)
        del p.conns_of(entry[1])[conn]
        p.conns_of(state)[conn] = self.clock()
        self._conns[conn] = (p, state)
        self._file(p)

    def touch(self, conn: Hashable) -> None:
        """The connection's client sent something: it becomes its peer's most recently active."""
        entry = self._conns.get(conn)
        if entry is None:
            return
        conns = entry[0].conns_of(entry[1])
        del conns[conn]
        conns[conn] = self.clock()

    def victim(self, peer: str | None = None) -> Hashable | None:
        """The connection to close for a newcomer from `peer` (None: one that holds none, and
        may take idle places only)."""
        now, held = self.clock(), self.held_by(peer)
        for p in self._candidates.most_first():
            if p.count < held:  # a crowded peer's newcomers take no idle place of a lesser one
                break
            conn = p.pick(now, self.stall_s)
            if conn is not None:
                return conn
        if peer is None:
            return None
        crowded = next(self._crowds.most_first(), None)
        if crowded is None or not over_share(crowded.count, held):
            return None
        return crowded.least_recently_active()

    def _unfile(self, p: _Peer, counted: bool = False) -> None:
        self._candidates.unfile(p)
        if counted:
            self._crowds.unfile(p)

    def _file(self, p: _Peer, counted: bool = False) -> None:
        if p.candidate():
            self._candidates.file(p)
        if counted:
            self._crowds.file(p)


def over_share(crowded: int, newcomers: int) -> bool:
    """Whether a peer holding `crowded` connections, the most of any, is over its share against
    a newcomer whose peer holds `newcomers`: whether, the newcomer counted, its peer would still
    hold fewer. Then, after the swap, the newcomer's peer holds no more than the crowded one,
    which cannot take its place back (no back and forth), and a peer's own newcomer never takes
    the place of its own connection. Repeated, every peer that wants more connections ends
    within one of the most crowded: max-min fair shares, cap / peers when all want more."""
    return newcomers + 1 < crowded
