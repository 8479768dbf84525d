"""Services shared by integration modules whose tests only send requests and leave them as they
found them (every page back in the pool): one start instead of one per module."""
from __future__ import annotations

import pytest

from tests.integration.harness import start_services


@pytest.fixture(scope="session")
def tiny_services(tmp_path_factory):
    """preset:tiny on default flags, for test_end_to_end, test_parallel_sampling and
    test_sampling_controls (a start and a stop cost ~6 s here)."""
    services = start_services(tmp_path_factory.mktemp("tiny"), ["--model", "preset:tiny"])
    yield services
    services.stop()
