"""ExecutorClient's stream operations over a fake Execute call: a result that does not come
within step_timeout_s, or a call that fails, marks the executor lost; a cancelled step loop is
cancelled, not turned into a lost executor."""
import asyncio

import grpc
import pytest

from scheduler_svc.executor_client import ExecutorClient, ExecutorLost
from scheduler_svc.plan import StepPlan


class SilentCall:
    """An Execute call whose reads never complete and whose writes fail if asked to."""

    def __init__(self, fail_writes: bool = False) -> None:
        self.fail_writes = fail_writes

    async def read(self):
        await asyncio.Event().wait()

    async def write(self, message) -> None:
        if self.fail_writes:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "gone")

    def cancel(self) -> None:
        pass


def client_with(call) -> ExecutorClient:
    client = ExecutorClient(["127.0.0.1:1"], step_timeout_s=0.05)
    client._call = call
    client.disconnected_since = None
    return client


def test_a_result_late_past_the_step_timeout_loses_the_executor():
    client = client_with(SilentCall())
    with pytest.raises(ExecutorLost, match="no result for step 7 within 0.05s"):
        asyncio.run(asyncio.wait_for(client.receive(StepPlan(7)), 5))
    assert client.disconnected_since is not None and client._call is None


def test_a_failed_write_loses_the_executor():
    client = client_with(SilentCall(fail_writes=True))
    with pytest.raises(ExecutorLost, match="UNAVAILABLE"):
        asyncio.run(client.send(StepPlan(1)))


def test_cancelling_a_wait_for_a_result_is_a_cancellation_not_a_lost_executor():
    client = client_with(SilentCall())
    client.step_timeout_s = 60

    async def body():
        task = asyncio.ensure_future(client.receive(StepPlan(1)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert client._call is not None
