"""gRPC calls that send their headers and never a message, on raw HTTP/2 connections (a grpc
client would hold a thread per call for its request iterator), kept open: a call the server ends
is opened again at once, as an attacker holding them would. Run as a program, so that the attack
does not share the test's process: `python -m tests.integration.silent_calls ADDRESS COUNT PATH...`
prints `holding` once every call is open, and its counts as JSON when stdin closes.
"""
from __future__ import annotations

import json
import socket
import sys
import threading

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0x1, 0x3, 0x4, 0x6, 0x7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_CANCEL = 0x8
PER_CONNECTION = 90  # under the executor's 100 open calls a connection


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


def _hpack_string(text: str) -> bytes:
    """A string literal without Huffman coding: 7-bit prefix length, then the bytes."""
    data, length, out = text.encode(), len(text.encode()), bytearray()
    if length < 127:
        return bytes((length,)) + data
    out.append(127)
    length -= 127
    while length >= 128:
        out.append(length % 128 + 128)
        length //= 128
    return bytes(out) + bytes((length,)) + data


def header_block(authority: str, path: str) -> bytes:
    """A request's headers, each a literal field without indexing (no HPACK table needed)."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path),
              (":authority", authority), ("content-type", "application/grpc"), ("te", "trailers")]
    return b"".join(b"\x00" + _hpack_string(k) + _hpack_string(v) for k, v in fields)


class _Connection:
    """One HTTP/2 connection holding `count` silent calls; answers the server's SETTINGS and
    PINGs, so keepalive does not close it."""

    def __init__(self, address: str, block: bytes, count: int, stats: SilentCalls) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=10)
        self._sock.settimeout(None)
        self._block, self._stats = block, stats
        self._lock = threading.Lock()
        self._next_id, self._open = 1, set()
        self._send(_PREFACE + _frame(_SETTINGS, 0, 0))
        for _ in range(count):
            self._open_call()
        threading.Thread(target=self._read, daemon=True, name="silent-calls").start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def _open_call(self) -> None:
        stream_id, self._next_id = self._next_id, self._next_id + 2
        self._open.add(stream_id)
        self._send(_frame(_HEADERS, _END_HEADERS, stream_id, self._block))
        self._stats.count_opened()

    def _read(self) -> None:
        try:
            while (frame := self._read_frame()) is not None:
                self._on_frame(*frame)
        except OSError:
            pass  # closed by close() or by the server

    def _read_frame(self):
        head = self._recv(9)
        if head is None:
            return None
        payload = self._recv(int.from_bytes(head[:3], "big"))
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    def _recv(self, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            chunk = self._sock.recv(size - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == _SETTINGS and not flags & _ACK:
            self._send(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            self._send(_frame(_PING, _ACK, 0, payload))
        elif kind == _GOAWAY:
            self._stats.count_goaway()
        elif stream_id in self._open and (kind == _RST_STREAM or flags & _END_STREAM):
            self._open.discard(stream_id)  # the server ended it: close our side, open another
            if kind != _RST_STREAM:
                self._send(_frame(_RST_STREAM, 0, stream_id, _CANCEL.to_bytes(4, "big")))
            self._stats.count_ended()
            if self._stats.holding:
                self._open_call()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class SilentCalls:
    """Holds `count` silent calls of `path` at `address` until close(): `opened` and `ended`
    count calls, `goaways` connections the server closed."""

    def __init__(self, address: str, path: str, count: int) -> None:
        self.holding = True
        self.opened = self.ended = self.goaways = 0
        self._lock = threading.Lock()
        block = header_block(address, path)
        sizes = [min(PER_CONNECTION, count - start) for start in range(0, count, PER_CONNECTION)]
        self._connections = [_Connection(address, block, size, self) for size in sizes]

    def count_opened(self) -> None:
        with self._lock:
            self.opened += 1

    def count_ended(self) -> None:
        with self._lock:
            self.ended += 1

    def count_goaway(self) -> None:
        with self._lock:
            self.goaways += 1

    def close(self) -> None:
        self.holding = False
        for connection in self._connections:
            connection.close()


def main(argv: list[str]) -> None:
    address, count, paths = argv[0], int(argv[1]), argv[2:]
    attacks = [SilentCalls(address, path, count) for path in paths]
    print("holding", flush=True)
    sys.stdin.read()
    for attack in attacks:
        attack.close()
    print(json.dumps({path: {"opened": a.opened, "ended": a.ended, "goaways": a.goaways}
                      for path, a in zip(paths, attacks)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
