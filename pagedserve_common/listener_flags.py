"""The flags both services read the same way: a secret from a flag or from its file, whether a
host accepts connections from this machine only (no token needed then), TLS files read before
anything starts, and the log level."""
from __future__ import annotations

import argparse
import ipaddress
import ssl

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """--log-level in any case (debug as DEBUG: logging itself takes only upper case); argparse
    then checks it against LOG_LEVELS."""
    return value.strip().upper()


def read_token(parser: argparse.ArgumentParser, value: str | None, path: str | None,
               flag: str) -> str | None:
    """The token given as `flag` or in the file of `flag`-file (stripped); both, an unreadable
    file or an empty one is a usage error naming the flag."""
    if value and path:
        parser.error(f"give {flag} or {flag}-file, not both")
    if path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as err:
            parser.error(f"{flag}-file: {err}")
        if not value:
            parser.error(f"{flag}-file {path} is empty")
    return value or None


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _reason(err: Exception) -> str:
    return getattr(err, "strerror", None) or getattr(err, "reason", None) or str(err)


def check_certificate(parser: argparse.ArgumentParser, cert: str | None, key: str | None) -> None:
    """--tls-cert and --tls-key: both or neither, a PEM certificate and its private key (gRPC
    reads them only when it binds, after the model loaded, and then blames the port)."""
    if bool(cert) != bool(key):
        parser.error("--tls-cert and --tls-key go together")
    if not cert:
        return
    try:  # an encrypted key gets an empty password, not a prompt
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (OSError, ValueError) as err:
        parser.error(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its "
                     f"unencrypted private key ({_reason(err)})")


def check_ca_bundle(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """A PEM CA bundle given as `flag`, read at start: the link would only fail at each attempt
    to reach an executor, retrying without end."""
    if not path:
        return
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ValueError) as err:
        parser.error(f"{flag} {path}: not a readable PEM CA bundle ({_reason(err)})")
