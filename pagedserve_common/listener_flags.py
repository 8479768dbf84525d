"""The flags both services read the same way: a secret from a flag or from its file, whether a
host accepts connections from this machine only (no token needed then), and the log level."""
from __future__ import annotations

import argparse
import ipaddress

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
