"""Services shared by integration modules whose tests only send requests and leave them as they
found them (every page back in the pool): one start instead of one per module."""
from __future__ import annotations

import pytest

from tests.integration.harness import openai_client, start_lone_executor, start_services


@pytest.fixture(scope="session")
def tiny_services(tmp_path_factory):
    """preset:tiny on default flags, for test_end_to_end, test_parallel_sampling,
    test_sampling_controls, test_poison and test_resilience's cancellation: one start for all."""
    services = start_services(tmp_path_factory.mktemp("tiny"), ["--model", "preset:tiny"])
    yield services
    services.stop()


@pytest.fixture(scope="session")
def tiny_executor(tmp_path_factory):
    """A preset:tiny executor on default flags for the tests and modules that need only a
    scheduler of their own flags (harness.attach_scheduler), one after another: the executor's
    start is most of a system's. None of them signals, kills or attacks it."""
    executor = start_lone_executor(tmp_path_factory.mktemp("tiny_executor"),
                                   ["--model", "preset:tiny"])
    yield executor
    executor.stop()


@pytest.fixture()
def client(services):
    """The OpenAI SDK on the HTTP API of the module's `services`."""
    return openai_client(services)
