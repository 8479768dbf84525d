"""The Executor gRPC service: Describe, and the Execute stream (one StepPlan in, one StepResult
out). Thin: messages through executor_svc.wire, the runner through a StepPipeline, one scheduler
at a time under a lease (executor_svc.lease); a stream not granted never touches the runner.
"""
from __future__ import annotations

import functools
import logging
import random
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from executor_svc import wire
from executor_svc.lease import Hello, Lease, LeaseRefused
from executor_svc.rpc_slots import (CallSlots, Evicted, MethodLimits, WaitingStreams,
                                    await_first)
from executor_svc.step import PlanMismatch
from executor_svc.step_pipeline import PlanReader, StepFailed, StepPipeline
from executor_svc.transport import AddressInUse, TransportConfig
from protos import executor_pb2, executor_pb2_grpc, reflection

log = logging.getLogger(__name__)

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Each method has a pool of threads of its own (callers with the token, others apart), and every
# call's first message has a deadline (--hello-timeout); calls waiting for it are capped per
# method, a newer one evicting one of the most crowded connection: see executor_svc.rpc_slots.
MAX_WAITING_STREAMS = 8  # Execute streams waiting for their hello
METHOD_LIMITS = {
    f"/{SERVICE_NAME}/Execute": MethodLimits(MAX_WAITING_STREAMS, reads_first=True),
    # Reflection streams hold a thread while open: 4 open (and 4 waiting) for v1 and v1alpha each.
    **{method: MethodLimits(4, max_open=4) for method in reflection.METHODS},
}
DEFAULT_LIMITS = MethodLimits(16)  # Describe, health Check and Watch: answered at once
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A second executor on this port must fail to start, not share the port with this one.
    ("grpc.so_reuseport", 0),
    # Calls queue on their method's pool rather than being refused: bound what one connection
    # can open at a time (the scheduler's link uses a few).
    ("grpc.max_concurrent_streams", 100),
    # Ping the scheduler, idle or not: a vanished scheduler's stream ends within ~15 s, which
    # frees the lease for another scheduler.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # An unanswered ping otherwise waits a minute before the link counts as gone.
    ("grpc.http2.ping_timeout_ms", 5_000),
    # Welcome the scheduler's own keepalive pings (every 10 s by default, never under 1 s) in
    # idle spells; the default policy (one per 5 min) answers them with GOAWAY too_many_pings.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
]


class Superseded(Exception):
    """A later lease grant took the runner: its state is no longer this stream's."""


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner, overlap_steps: bool = True, allow_takeover: bool = False,
                 hello_timeout_s: float = TransportConfig.hello_timeout_s,
                 max_waiting_streams: int = MAX_WAITING_STREAMS) -> None:
        self.runner = runner  # a ModelRunner: info, reset(), launch(step), finish(pending)
        self.instance_id = random.getrandbits(63)
        # 2: launch step N+1 before finishing step N; 1: one step at a time.
        self.max_launched_steps = 2 if overlap_steps else 1
        self.hello_timeout_s = hello_timeout_s
        self.lease = Lease(allow_takeover)
        self.waiting = WaitingStreams(max_waiting_streams)
        self._lock = threading.Lock()  # one runner call at a time

    def Describe(self, request, context):
        return wire.info_to_proto(self.runner.info, self.instance_id)

    def Execute(self, request_iterator, context):
        reader = PlanReader(request_iterator)
        hello = self._read_hello(reader, context)
        generation = self._grant(hello, reader, context)
        try:
            yield executor_pb2.StepResult(step_id=0)  # the lease is this stream's
            pipeline = StepPipeline(functools.partial(self._launch, generation),
                                    functools.partial(self._finish, generation),
                                    self.max_launched_steps, on_idle=self._idle)
            for result in pipeline.run(reader):
                yield wire.result_to_proto(result)
        except StepFailed as failure:
            self._abort(context, generation, failure)
        except Superseded:
            context.abort(grpc.StatusCode.ABORTED, "superseded by a newer Execute stream")
        finally:
            self.lease.release(generation)

    def _read_hello(self, reader: PlanReader, context) -> Hello:
        """The stream's first message as a Hello; closes the stream if it is anything else, does
        not come within hello_timeout_s, or a newer stream evicts this one while it waits."""
        first = await_first(self.waiting, context, reader.first,
                            lambda: reader.interrupt(Evicted()), self.hello_timeout_s,
                            "lease hello", "Execute streams")
        hello = hello_from_proto(first)
        if hello is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the first message of an Execute stream must be a lease hello: step 0 "
                          "with only `lease` set (a scheduler_id and an epoch >= 1)")
        if first.lease.protocol_version != executor_pb2.PROTOCOL_VERSION:
            refusal = (f"the scheduler speaks executor protocol version "
                       f"{first.lease.protocol_version}, this executor version "
                       f"{executor_pb2.PROTOCOL_VERSION} (run one pagedserve release on both)")
            log.warning("Execute from %s refused: %s", context.peer(), refusal)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        return hello

    def _grant(self, hello: Hello, reader: PlanReader, context) -> int:
        """Grants the lease and resets the runner for its new holder; closes the stream if the
        lease is refused or the client has already gone (then the runner is not touched)."""
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "the client left before its hello was read")
        try:
            generation = self.lease.grant(hello, context.is_active,
                                          lambda: reader.interrupt(Superseded()))
        except LeaseRefused as refused:
            log.warning("Execute from %s refused (scheduler %s, epoch %d): %s", context.peer(),
                        hello.scheduler_id, hello.epoch, refused)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(refused))
        with self._lock:
            if self.lease.is_current(generation):
                self.runner.reset()
        log.info("lease %d granted to scheduler %s (epoch %d%s) at %s", generation,
                 hello.scheduler_id, hello.epoch, ", takeover" if hello.takeover else "",
                 context.peer())
        return generation

    def _launch(self, generation: int, plan):
        if plan.HasField("lease"):
            raise PlanMismatch(f"step {plan.step_id} carries a lease: only the first message may")
        step = wire.plan_from_proto(plan)
        with self._lock:
            self._check_current(generation)
            return self.runner.launch(step)

    def _finish(self, generation: int, pending):
        with self._lock:
            self._check_current(generation)
            return self.runner.finish(pending)

    def _idle(self) -> None:
        with self._lock:
            self.runner.idle()

    def _check_current(self, generation: int) -> None:
        if not self.lease.is_current(generation):
            raise Superseded()

    def _abort(self, context, generation: int, failure: StepFailed) -> None:
        """Maps a failed step to a status; the runner's state is dropped unless a newer stream
        owns it now."""
        err = failure.cause
        if isinstance(err, Superseded):
            context.abort(grpc.StatusCode.ABORTED, "superseded by a newer Execute stream")
        with self._lock:  # a failed step may leave partial state: drop it all
            if self.lease.is_current(generation):
                self.runner.reset()
        if isinstance(err, PlanMismatch):
            context.set_trailing_metadata(wire.failure_metadata(err))  # the seqs at fault, if any
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        log.error("step %d failed", failure.step_id, exc_info=err)
        context.abort(grpc.StatusCode.INTERNAL, f"step {failure.step_id} failed: {err!r}")


def hello_from_proto(plan: executor_pb2.StepPlan | None) -> Hello | None:
    """The Hello in a stream's first message; None unless it is exactly step 0 with a lease."""
    if plan is None or not plan.HasField("lease"):
        return None
    lease = plan.lease
    if not lease.scheduler_id or lease.epoch < 1 or plan != executor_pb2.StepPlan(lease=lease):
        return None
    return Hello(lease.scheduler_id, lease.epoch, lease.takeover)


def build_server(runner, address: str, transport: TransportConfig = TransportConfig(),
                 overlap_steps: bool = True):
    """A grpc server with the Executor, health and reflection services; returns (server, port).
    Raises AddressInUse if the address cannot be bound. A takeover of the lease is honoured only
    with a token, which authenticates it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),  # refusals only
                         interceptors=[call_slots(transport)], options=SERVER_OPTIONS)
    servicer = ExecutorServicer(runner, overlap_steps, allow_takeover=bool(transport.auth_token),
                                hello_timeout_s=transport.hello_timeout_s)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    return server, _bind(server, address, transport)


def call_slots(transport: TransportConfig) -> CallSlots:
    """The interceptor that gives each call its method's threads and checks the token."""
    return CallSlots(METHOD_LIMITS, DEFAULT_LIMITS, transport.hello_timeout_s,
                     transport.auth_token, guarded_prefix=f"/{SERVICE_NAME}/")


def _bind(server, address: str, transport: TransportConfig) -> int:
    credentials = transport.server_credentials()
    try:
        port = (server.add_secure_port(address, credentials) if credentials
                else server.add_insecure_port(address))
    except RuntimeError:  # grpc only says "Failed to bind"; its C log has the cause
        port = 0
    if port == 0:
        raise AddressInUse(f"cannot listen on {address}: the port is in use, or the address is "
                           "not this host's (grpc's log line above has the cause)")
    return port
