"""ExecutorClient's stream operations over a fake Execute call: a result that does not come
within step_timeout_s, or a call that fails, marks the executor lost; a cancelled step loop is
cancelled, not turned into a lost executor. Over an in-process server: a stream that ends while
idle, and a pass over the addresses refused by every executor, are reported at once; an
executor of another protocol version is refused before any stream opens; before the first attach
an executor that starts listening is found within STARTUP_BACKOFF_S."""
import asyncio
import logging

import grpc
import pytest

from protos import executor_pb2, executor_pb2_grpc
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


class ReplyingCall(SilentCall):
    """An Execute call whose reads return `reply`."""

    def __init__(self, reply) -> None:
        super().__init__()
        self.reply = reply

    async def read(self):
        return self.reply


def test_a_result_whose_columns_do_not_line_up_loses_the_executor():
    reply = executor_pb2.StepResult(step_id=3, sampled=executor_pb2.SampledTokens(
        seq_ids=[1, 2], token_ids=[5]))
    client = client_with(ReplyingCall(reply))
    with pytest.raises(ExecutorLost, match="its result for step 3 does not read: sampled: 2 seq"):
        asyncio.run(client.receive(StepPlan(3)))
    assert client._call is None


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


class LeaseServicer(executor_pb2_grpc.ExecutorServicer):
    """An executor that acknowledges the lease hello, or refuses it as leased when `refusal`;
    Describe names `protocol_version`."""

    def __init__(self, refusal: str | None = None,
                 protocol_version: int = executor_pb2.PROTOCOL_VERSION) -> None:
        self.refusal, self.protocol_version, self.streams = refusal, protocol_version, 0

    async def Describe(self, request, context):
        return executor_pb2.DescribeResponse(model_name="m", fingerprint="f", block_size=4,
                                             num_gpu_blocks=8, max_model_len=64, vocab_size=10,
                                             protocol_version=self.protocol_version)

    async def Execute(self, request_iterator, context):
        self.streams += 1
        async for _ in request_iterator:
            if self.refusal:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refusal)
            yield executor_pb2.StepResult(step_id=0)


async def serving(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_stream_that_ends_while_idle_is_reported_at_once():
    async def body():
        server, address = await serving(LeaseServicer())
        client = ExecutorClient([address])
        ended = asyncio.get_running_loop().create_future()
        client.on_stream_end = ended.set_result
        assert await client.connect() is not None
        await asyncio.sleep(0.2)
        assert not ended.done()  # an idle stream is no ending
        await server.stop(0)  # the executor goes away while nothing is read or written
        reason = await asyncio.wait_for(ended, 5)
        assert reason.startswith("its Execute stream ended: "), reason
        await client.close()

    asyncio.run(body())


def test_closing_the_link_is_not_reported_as_its_end():
    async def body():
        server, address = await serving(LeaseServicer())
        client = ExecutorClient([address])
        ended = []
        client.on_stream_end = ended.append
        await client.connect()
        await client.close()
        await asyncio.sleep(0.2)
        await server.stop(0)
        assert ended == []

    asyncio.run(body())


def test_a_pass_refused_by_every_executor_is_reported_and_retried():
    async def body():
        refusal = "executor is leased by another scheduler (id x, since then)"
        servicer = LeaseServicer(refusal)
        server, address = await serving(servicer)
        client = ExecutorClient([address], max_backoff_s=0.05)
        refusals = []
        client.on_refused = refusals.append
        connect = asyncio.ensure_future(client.connect())
        while len(refusals) < 2:  # refused, retried, refused again
            await asyncio.sleep(0.01)
        assert f"executor {address} refused this scheduler's stream: FAILED_PRECONDITION: " \
            f"{refusal}" == refusals[0]
        servicer.refusal = None  # the other scheduler let go
        assert (await asyncio.wait_for(connect, 5)).model_name == "m"
        await client.close()
        await server.stop(0)

    asyncio.run(body())


@pytest.mark.parametrize("version", [0, executor_pb2.PROTOCOL_VERSION + 1])
def test_an_executor_of_another_protocol_version_is_refused_naming_both(version, caplog):
    async def body() -> str:
        servicer = LeaseServicer(protocol_version=version)
        server, address = await serving(servicer)
        client = ExecutorClient([address])
        with caplog.at_level(logging.ERROR, logger="scheduler_svc.executor_client"):
            assert await client.connect_once() is None
        assert servicer.streams == 0  # refused on Describe's answer: no stream was opened
        servicer.protocol_version = executor_pb2.PROTOCOL_VERSION
        assert (await client.connect_once()).model_name == "m"
        await client.close()
        await server.stop(0)
        return address

    address = asyncio.run(body())
    # the client's errors: grpc's own logger may report the stub server's stream cancelled at stop
    client_errors = [r.getMessage() for r in caplog.records
                     if r.levelno >= logging.ERROR and r.name == "scheduler_svc.executor_client"]
    assert client_errors == [
        f"refusing executor {address}: it speaks executor protocol version {version}, this "
        f"scheduler version {executor_pb2.PROTOCOL_VERSION} (run one pagedserve release on both)"]


def test_before_the_first_attach_an_executor_is_found_soon_after_it_starts():
    """An executor that starts listening a while after the scheduler (it was loading) is
    attached within STARTUP_BACKOFF_S of it, not after the whole retry interval's doubling
    (tries at 1.55 and 3.15 s here): connect polls faster until the first attach."""
    import socket
    import time

    from scheduler_svc.executor_client import STARTUP_BACKOFF_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body() -> float:
        client = ExecutorClient([f"127.0.0.1:{port}"], max_backoff_s=2.0)
        t0 = time.monotonic()
        connect = asyncio.ensure_future(client.connect())
        await asyncio.sleep(2.2)  # nothing listens yet: every pass is refused
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(LeaseServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        started = time.monotonic() - t0
        assert (await asyncio.wait_for(connect, 5)).model_name == "m"
        waited = time.monotonic() - t0 - started
        await client.close()
        await server.stop(0)
        return waited

    assert asyncio.run(body()) < STARTUP_BACKOFF_S + 0.35
