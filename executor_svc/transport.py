"""Transport security of the executor's gRPC server: optional TLS and a shared bearer token.

The token guards the Executor service only; health and reflection stay open for probes.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc

TOKEN_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class TransportConfig:
    tls_cert: str | None = None  # PEM file paths; both or neither
    tls_key: str | None = None
    auth_token: str | None = None

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
