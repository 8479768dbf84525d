"""The public servicer in-process over a fake engine: an unexpected exception becomes INTERNAL with
the request id (its traceback goes to the log, never to the client), and long error details are
cut short."""
import asyncio
import logging

import grpc

from protos import generate_pb2, generate_pb2_grpc
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.server import MAX_DETAILS_CHARS, Listeners, build_servers


class FailingEngine:
    """Raises `error` from generate_batches(), after yielding nothing."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def generate_batches(self, spec):
        raise self.error
        yield  # an async generator, like Engine.generate_batches


async def call(engine, request: generate_pb2.GenerateRequest):
    public, admin, _, port, _ = build_servers(engine, Listeners(public="127.0.0.1:0",
                                                                admin="127.0.0.1:0"))
    await public.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.GeneratorStub(channel)
            try:
                [m async for m in stub.Generate(request, timeout=10)]
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""
    finally:
        await public.stop(None)
        await admin.stop(None)


def test_an_unexpected_exception_is_internal_with_the_request_id(caplog):
    request = generate_pb2.GenerateRequest(text="hi", request_id="req-7")
    with caplog.at_level(logging.ERROR, logger="scheduler_svc.server"):
        code, details = asyncio.run(call(FailingEngine(KeyError("secret internals")), request))
    assert code == grpc.StatusCode.INTERNAL
    assert "req-7" in details and "secret internals" not in details
    assert "KeyError" not in details and "Unexpected" not in details
    record = next(r for r in caplog.records if "req-7" in r.getMessage())
    assert record.exc_info is not None and record.exc_info[0] is KeyError


def test_long_details_are_cut():
    error = InvalidArgument("stop", "x" * 100_000)
    code, details = asyncio.run(call(FailingEngine(error), generate_pb2.GenerateRequest(text="hi")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(details) <= MAX_DETAILS_CHARS and details.startswith("stop: xxx")
