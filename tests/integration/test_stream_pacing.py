"""Tokens leave as they are made on a reused connection, on both public ports: the second
streamed request of a keep-alive HTTP connection and the second Generate call of a gRPC channel
arrive over many reads, not as one burst once the client's delayed ACK frees Nagle's buffer."""
import json
import socket
import time

import grpc

from protos import generate_pb2

MAX_TOKENS = 32
PROMPT = [5, 17, 42, 99, 7, 3]
# Tokens arriving in at least this many separate reads (a quarter of them): made one a step, they
# arrive nearly one a read; Nagle's algorithm holds them for each delayed ACK, a few bursts in all.
MIN_READS = MAX_TOKENS // 4


def _http_request() -> bytes:
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _read_stream(sock: socket.socket) -> list[bytes]:
    """One chunked response's reads, until its last chunk."""
    reads, seen = [], b""
    while not seen.endswith(b"0\r\n\r\n"):
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        reads.append(data)
        seen += data
    return reads


def test_a_reused_http_connection_streams_tokens_as_they_are_made(tiny_services):
    with socket.create_connection(("127.0.0.1", tiny_services.http_port), timeout=60) as sock:
        sock.sendall(_http_request())
        _read_stream(sock)  # the first request: its ACKs leave the connection warmed up
        sock.sendall(_http_request())
        reads = _read_stream(sock)
    with_tokens = [r for r in reads if b'"text"' in r]
    assert sum(r.count(b"data: {") for r in reads) >= MAX_TOKENS
    assert len(with_tokens) >= MIN_READS, [len(r) for r in reads]


def test_a_reused_grpc_channel_streams_tokens_as_they_are_made(tiny_services):
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(PROMPT)
    req.stopping.max_tokens = MAX_TOKENS
    req.stopping.ignore_eos = True
    with grpc.insecure_channel(tiny_services.scheduler_address) as channel:
        stub = tiny_services.stub(channel)
        list(stub.Generate(req, timeout=60))
        arrivals = [time.perf_counter() for _ in stub.Generate(req, timeout=60)]
    bursts = 1 + sum(1 for a, b in zip(arrivals, arrivals[1:]) if b - a > 0.0005)
    assert len(arrivals) >= MAX_TOKENS // 2
    assert bursts >= MIN_READS, [round((b - arrivals[0]) * 1000, 1) for b in arrivals]
