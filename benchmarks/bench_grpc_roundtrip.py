"""The transport's share of a request (issue 12): the round trip of one StepPlan and its
StepResult over the Execute stream, as the scheduler's grpc.aio client sees it (with its channel
options), against an echo server of each kind the executor could be (the sync server it is, with
a thread pool, and a grpc.aio one), and against the executor's own arrangement with a no-op step
(its server options and stream limit, its plan-reader thread and StepPipeline), each in its own
process on a local port. No model: what is left is gRPC's C core, its Python glue and the thread
or event-loop hops on both sides.

    python -m benchmarks.bench_grpc_roundtrip --round-trips 3000

A cached-prefix request crosses this stream once (plan out, result back) and the client's
Generate stream once (request in, token out); what the services spend beyond those crossings is
their own Python work.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from executor_svc.server import SERVER_OPTIONS, call_slots  # noqa: E402
from executor_svc.step_pipeline import StepPipeline  # noqa: E402
from executor_svc.transport import TransportConfig  # noqa: E402
from protos import executor_pb2, executor_pb2_grpc  # noqa: E402
from scheduler_svc.executor_client import channel_options  # noqa: E402
from scripts.local_services import free_port  # noqa: E402


class _SyncEcho(executor_pb2_grpc.ExecutorServicer):
    def Execute(self, request_iterator, context):
        for plan in request_iterator:
            yield executor_pb2.StepResult(step_id=plan.step_id)


class _AioEcho(executor_pb2_grpc.ExecutorServicer):
    async def Execute(self, request_iterator, context):
        async for plan in request_iterator:
            yield executor_pb2.StepResult(step_id=plan.step_id)


class _Done:
    """A launched no-op step: ready at once, as the CPU backend's steps are."""

    def __init__(self, plan) -> None:
        self.step_id = plan.step_id

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class _PipelinedEcho(executor_pb2_grpc.ExecutorServicer):
    """The executor's Execute without a model: its plan-reader thread and StepPipeline."""

    def Execute(self, request_iterator, context):
        pipeline = StepPipeline(_Done, lambda done: done, on_idle=lambda: None)
        for done in pipeline.run(request_iterator):
            yield executor_pb2.StepResult(step_id=done.step_id)


def _serve_sync(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    executor_pb2_grpc.add_ExecutorServicer_to_server(_SyncEcho(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _serve_executor_like(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS,
                         interceptors=[call_slots(TransportConfig())])
    executor_pb2_grpc.add_ExecutorServicer_to_server(_PipelinedEcho(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _serve_aio(port: int) -> None:
    async def serve() -> None:
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(_AioEcho(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def _round_trips(port: int, count: int, warmup: int) -> list[float]:
    """Seconds from each plan's write to its result's read, after `warmup` untimed ones."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         options=channel_options(10.0)) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        call = executor_pb2_grpc.ExecutorStub(channel).Execute()
        times = []
        for step_id in range(warmup + count):
            start = time.perf_counter()
            await call.write(executor_pb2.StepPlan(step_id=step_id))
            result = await call.read()
            if result.step_id != step_id:
                raise RuntimeError(f"result for step {result.step_id}, expected {step_id}")
            times.append(time.perf_counter() - start)
        await call.done_writing()
    return times[warmup:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--round-trips", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args(argv)
    for name, serve in (("sync server (the executor's kind)", _serve_sync),
                        ("grpc.aio server", _serve_aio),
                        ("the executor's options, reader thread and pipeline",
                         _serve_executor_like)):
        port = free_port()
        proc = multiprocessing.Process(target=serve, args=(port,), daemon=True)
        proc.start()
        try:
            ms = sorted(1e3 * t for t in asyncio.run(_round_trips(port, args.round_trips,
                                                                  args.warmup)))
        finally:
            proc.terminate()
            proc.join()
        print(f"{name}: {len(ms)} round trips, median {statistics.median(ms):.3f} ms, "
              f"p10 {ms[len(ms) // 10]:.3f}, p90 {ms[9 * len(ms) // 10]:.3f}", flush=True)


if __name__ == "__main__":
    main()
