"""Runs pip for tests that install something (an older transformers, the scheduler as its image
does); skips the test when no package index answers. Imports nothing of the project."""
from __future__ import annotations

import subprocess

import pytest

# pip's own words when it could not reach an index or found nothing there
_OFFLINE_SIGNS = ("from versions: none", "NewConnectionError", "Failed to establish a new connection",
                  "Temporary failure in name resolution", "Network is unreachable", "ProxyError",
                  "ConnectTimeoutError", "ReadTimeoutError")


def pip_install(python: str, args: list[str], cwd=None, timeout: float = 600) -> None:
    """`python -m pip install ARGS` (in `cwd`): skips the test where no package index answers,
    fails it for any other pip error."""
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "30", *args]
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if result.returncode == 0:
        return
    offline = [line.strip() for line in result.stderr.splitlines() if any(s in line for s in _OFFLINE_SIGNS)]
    if offline:
        pytest.skip(f"no package index reachable for `pip install {' '.join(args)}`: {offline[-1]}")
    raise AssertionError(f"`pip install {' '.join(args)}` failed:\n{result.stderr[-3000:]}")
