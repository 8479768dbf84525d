"""The Executor gRPC service: Describe, and the Execute stream (one StepPlan in, one StepResult out).

Thin: converts messages with executor_svc.wire and calls the Worker. A new Execute stream starts
from empty executor-side state and supersedes any older stream still open.
"""
from __future__ import annotations

import logging
import random
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_svc import wire
from executor_svc.step import PlanMismatch
from executor_svc.transport import TokenInterceptor, TransportConfig
from protos import executor_pb2, executor_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, worker) -> None:
        self.worker = worker
        self.instance_id = random.getrandbits(63)
        self.executed_steps = 0
        self._lock = threading.Lock()  # one step at a time on the worker
        self._stream_generation = 0

    def Describe(self, request, context):
        return wire.info_to_proto(self.worker.describe(), self.instance_id)

    def Execute(self, request_iterator, context):
        with self._lock:
            self._stream_generation += 1
            generation = self._stream_generation
            self.worker.reset()
        log.info("execute stream %d opened", generation)
        for plan in request_iterator:
            with self._lock:
                if generation != self._stream_generation:
                    context.abort(grpc.StatusCode.ABORTED, "superseded by a newer Execute stream")
                try:
                    output = self.worker.execute(wire.step_from_proto(plan))
                except PlanMismatch as err:
                    self.worker.reset()
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
                except Exception as err:  # a failed forward may leave partial state: drop it all
                    log.exception("step %d failed", plan.step_id)
                    self.worker.reset()
                    context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {err!r}")
                self.executed_steps += 1
            yield wire.output_to_proto(output, self.executed_steps)


def build_server(worker, address: str, transport: TransportConfig = TransportConfig()):
    """A grpc server with the Executor, health and reflection services; returns (server, port)."""
    interceptors = ([TokenInterceptor(transport.auth_token, SERVICE_NAME)]
                    if transport.auth_token else [])
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=interceptors,
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(worker), server)
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
