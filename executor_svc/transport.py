"""The executor's listener settings: optional TLS, a shared bearer token, the first-message
deadline, and the check that its address is free. (executor_svc.rpc_slots applies the token and
the deadline to each call.)
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TransportConfig:
    tls_cert: str | None = None  # PEM file paths; both or neither
    tls_key: str | None = None
    auth_token: str | None = None
    # A call without its first message by then (an Execute stream: its lease hello) is closed.
    hello_timeout_s: float = 5.0

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert and not self.tls_key:
            return None
        if not (self.tls_cert and self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        with open(self.tls_key, "rb") as key, open(self.tls_cert, "rb") as cert:
            return grpc.ssl_server_credentials([(key.read(), cert.read())])


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
