"""The Executor gRPC service: Describe, and the Execute stream (one StepPlan in, one StepResult out).

Thin: converts messages with executor_svc.wire and calls the Worker through a StepPipeline (step
N+1 is launched before step N is finished when its plan is already there). A new Execute stream
starts from empty executor-side state and supersedes any older stream still open.
"""
from __future__ import annotations

import functools
import logging
import random
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_svc import wire
from executor_svc.step import PlanMismatch
from executor_svc.step_pipeline import StepFailed, StepPipeline
from executor_svc.transport import TokenInterceptor, TransportConfig
from protos import executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class Superseded(Exception):
    """A newer Execute stream has opened: the worker's state is no longer this stream's."""


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, worker, overlap_steps: bool = True) -> None:
        self.worker = worker
        self.instance_id = random.getrandbits(63)
        self.executed_steps = 0
        # 2: launch step N+1 before finishing step N; 1: one step at a time.
        self.max_steps_in_flight = 2 if overlap_steps else 1
        self._lock = threading.Lock()  # one worker call at a time
        self._stream_generation = 0

    def Describe(self, request, context):
        return wire.info_to_proto(self.worker.describe(), self.instance_id)

    def Execute(self, request_iterator, context):
        with self._lock:
            self._stream_generation += 1
            generation = self._stream_generation
            self.worker.reset()
        log.info("execute stream %d opened", generation)
        pipeline = StepPipeline(functools.partial(self._launch, generation),
                                functools.partial(self._finish, generation),
                                self.max_steps_in_flight)
        try:
            for output, executed_steps in pipeline.run(request_iterator):
                yield wire.output_to_proto(output, executed_steps)
        except StepFailed as failure:
            self._abort(context, generation, failure)

    def _launch(self, generation: int, plan):
        step = wire.step_from_proto(plan)
        with self._lock:
            self._check_current(generation)
            return self.worker.launch(step)

    def _finish(self, generation: int, pending):
        with self._lock:
            self._check_current(generation)
            output = self.worker.finish(pending)
            self.executed_steps += 1
            return output, self.executed_steps

    def _check_current(self, generation: int) -> None:
        if generation != self._stream_generation:
            raise Superseded()

    def _abort(self, context, generation: int, failure: StepFailed) -> None:
        """Maps a failed step to a status; the worker's state is dropped unless a newer stream
        owns it now."""
        err = failure.cause
        if isinstance(err, Superseded):
            context.abort(grpc.StatusCode.ABORTED, "superseded by a newer Execute stream")
        with self._lock:  # a failed step may leave partial state: drop it all
            if generation == self._stream_generation:
                self.worker.reset()
        if isinstance(err, PlanMismatch):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        log.error("step %d failed", failure.step_id, exc_info=err)
        context.abort(grpc.StatusCode.INTERNAL, f"step {failure.step_id} failed: {err!r}")


def build_server(worker, address: str, transport: TransportConfig = TransportConfig(),
                 overlap_steps: bool = True):
    """A grpc server with the Executor, health and reflection services; returns (server, port)."""
    interceptors = ([TokenInterceptor(transport.auth_token, SERVICE_NAME)]
                    if transport.auth_token else [])
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=interceptors,
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(worker, overlap_steps), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    credentials = transport.server_credentials()
    port = (server.add_secure_port(address, credentials) if credentials
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    return server, port
