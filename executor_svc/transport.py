"""The executor's listener: optional TLS, a shared bearer token, limits on open streams, and the
check that its address is free.

The token guards the Executor service only; health and reflection stay open for probes.
"""
from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
from dataclasses import dataclass

import grpc

TOKEN_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class TransportConfig:
    tls_cert: str | None = None  # PEM file paths; both or neither
    tls_key: str | None = None
    auth_token: str | None = None
    hello_timeout_s: float = 5.0  # an Execute stream without its lease hello by then is closed

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert and not self.tls_key:
            return None
        if not (self.tls_cert and self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        with open(self.tls_key, "rb") as key, open(self.tls_cert, "rb") as cert:
            return grpc.ssl_server_credentials([(key.read(), cert.read())])


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls to `guarded_service` that lack `authorization: Bearer <token>`."""

    def __init__(self, token: str, guarded_service: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._prefix = f"/{guarded_service}/"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong executor token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(
            lambda request_iterator, context: deny(None, context))

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(self._prefix):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(TOKEN_METADATA_KEY, "").encode()
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny


class StreamLimits(grpc.ServerInterceptor):
    """At most `limits[method]` open calls of each listed response-streaming method; more are
    refused at once with RESOURCE_EXHAUSTED. In a sync server an open stream that reads its
    requests (reflection) holds a worker thread, so unbounded ones could take the threads that
    Describe and the scheduler's Execute stream need. (Health Watch needs no limit: grpc's
    servicer answers it without holding a thread.)"""

    def __init__(self, limits: dict[str, int]) -> None:
        self._slots = {method: threading.BoundedSemaphore(n) for method, n in limits.items()}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        slots = self._slots.get(handler_call_details.method)
        if handler is None or slots is None or not handler.response_streaming:
            return handler
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _limited(handler.stream_stream, slots), handler.request_deserializer,
                handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(
            _limited(handler.unary_stream, slots), handler.request_deserializer,
            handler.response_serializer)


def _limited(behavior, slots: threading.BoundedSemaphore):
    def limited(request, context):
        if not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open streams of this "
                          "method; try again when one ends")
        try:
            yield from behavior(request, context)
        finally:
            slots.release()
    return limited


class AddressInUse(RuntimeError):
    """Another process listens on the executor's address."""


def check_can_listen(host: str, port: int) -> None:
    """Raises AddressInUse if something already listens on host:port. Checked before the model
    loads, so a second executor on a busy port fails at once, not after minutes of loading (the
    server's own bind, without SO_REUSEPORT, is the final word). SO_REUSEADDR lets the check
    pass over connections of a previous executor that are still in TIME_WAIT."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # a name this check cannot resolve: the server's bind reports it
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as err:
                raise AddressInUse(f"cannot listen on {host}:{port}: {err.strerror} (is another "
                                   "executor running there?)") from err


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
