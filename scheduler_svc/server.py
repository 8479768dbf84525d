"""The scheduler's two gRPC listeners, public (Generate, ModelInfo; behind the connection gate)
and admin (SetExecutors, GetStatus), as thin servicers: message in, one engine call, messages
out; domain errors become status codes in `_status_for` alone.
"""
from __future__ import annotations

import dataclasses
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from protos import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc, reflection
from scheduler_svc import wire
from scheduler_svc.admission import NoExecutor, QueueFull, ShuttingDown
from scheduler_svc.connection_gate import ConnectionGate, GateLimits, PrivateSocketDir, client_peer
from scheduler_svc.engine import Engine
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.output import EngineFailed
from scheduler_svc.request import RequestLimits

log = logging.getLogger(__name__)

_STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoExecutor: grpc.StatusCode.UNAVAILABLE,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    EngineFailed: grpc.StatusCode.INTERNAL,
}
# Status details travel in a header: a client's header limit (8 KiB by default) must never turn
# an error into RESOURCE_EXHAUSTED, whatever the request echoed into it.
MAX_DETAILS_CHARS = 1024


def _status_for(err: Exception) -> grpc.StatusCode | None:
    """The status code of a domain error; None for anything else, which the servicers log with
    the request id and answer INTERNAL."""
    for kind, code in _STATUS.items():
        if isinstance(err, kind):
            return code
    return None


def _details(err: Exception) -> str:
    text = str(err)
    return text if len(text) <= MAX_DETAILS_CHARS else text[:MAX_DETAILS_CHARS - 3] + "..."


class _Undecodable:
    """Stands in for a request that is not a valid message (e.g. bad UTF-8 in a string field)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(parse):
    """A deserializer that lets the servicer answer INVALID_ARGUMENT instead of grpc's UNKNOWN."""
    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as err:
            return _Undecodable(str(err))
    return deserialize


class GeneratorServicer(generate_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, limits: RequestLimits) -> None:
        self.engine = engine
        self.limits = limits

    async def Generate(self, request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.reason}")
        request_id = ""
        try:
            spec = wire.spec_from_proto(request, request.request_id or uuid.uuid4().hex,
                                        self.limits)
            request_id = spec.request_id
            remaining = context.time_remaining()  # None: the client set no deadline
            if remaining is not None:
                spec = dataclasses.replace(spec, deadline=time.monotonic() + remaining)
            async for events in self.engine.generate_batches(spec):
                for msg in wire.events_to_protos(events, request_id):
                    yield msg
        except Exception as err:  # noqa: BLE001 - every error gets a status, none leaks a trace
            code = _status_for(err)
            if code is None:
                log.error("request %s failed", request_id or "(invalid id)", exc_info=err)
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"internal error in request {request_id or '(invalid id)'}; "
                                    "the scheduler's log has the details")
            # gRPC's retry pushback (gRFC A6): when a retrying client may try again
            pushback = ((("grpc-retry-pushback-ms", str(err.retry_after_s * 1000)),)
                        if isinstance(err, QueueFull) else ())
            await context.abort(code, _details(err), pushback)

    async def ModelInfo(self, request, context):
        try:
            m = self.engine.model_info()
        except NoExecutor as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _details(err))
        return generate_pb2.ModelInfoResponse(
            model_name=m.model_name, fingerprint=m.fingerprint, max_model_len=m.max_model_len,
            vocab_size=m.vocab_size, eos_token_id=m.eos_token_id or 0, dtype=m.dtype,
            block_size=m.block_size, num_gpu_blocks=m.num_gpu_blocks,
            num_cpu_blocks=m.num_cpu_blocks, quantization=m.quantization,
            kv_cache_dtype=m.kv_cache_dtype)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def SetExecutors(self, request, context):
        addresses = [a.strip() for a in request.addresses if a.strip()]
        if not addresses:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "addresses: must not be empty")
        log.warning("Admin.SetExecutors from %s: %s", context.peer(), ", ".join(addresses)[:500])
        try:
            address, model_name, moved = await self.engine.switch_executor(addresses)
        except (InvalidArgument, NoExecutor, EngineFailed) as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _details(err))
        return admin_pb2.SetExecutorsResponse(address=address, model_name=model_name,
                                              moved_sequences=moved)

    async def GetStatus(self, request, context):
        s = self.engine.status()
        q = s.scheduler
        return admin_pb2.GetStatusResponse(
            executor_address=s.executor_address, executor_attached=s.attached,
            running=q.running, waiting=q.waiting, swapped=q.swapped,
            gpu_blocks_used=q.gpu_blocks_used, gpu_blocks_total=q.gpu_blocks_total,
            cpu_blocks_used=q.cpu_blocks_used, cpu_blocks_total=q.cpu_blocks_total,
            steps=s.steps, resyncs=s.resyncs, draining=s.draining, model_name=s.model_name,
            attach_error=s.attach_error, loop_failures=s.loop_failures)


class _AdminToken(grpc.aio.ServerInterceptor):
    """Refuses Admin calls without `authorization: Bearer <token>` (compared in constant time)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._prefix = f"/{ADMIN_SERVICE_NAME}/"

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self._prefix):
            given = dict(details.invocation_metadata or ()).get("authorization", "")
            if not hmac.compare_digest(str(given).encode(), self._expected):
                return _refusal(details.method, grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong admin token")
        return await continuation(details)


def _refusal(method: str, code: grpc.StatusCode, reason: str):
    """A handler that logs the refused call with its peer and answers `code`."""
    async def refuse(request, context):
        log.warning("refused %s from %s: %s", method, client_peer(context.peer()), reason)
        await context.abort(code, reason)
    return grpc.unary_unary_rpc_method_handler(refuse)


SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generator"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


def _add_generator(servicer: GeneratorServicer, server) -> None:
    """As the generated add_GeneratorServicer_to_server, with a lenient Generate deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(generate_pb2.GenerateRequest.FromString),
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo,
            request_deserializer=generate_pb2.ModelInfoRequest.FromString,
            response_serializer=generate_pb2.ModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _refuse_admin(server) -> None:
    """Admin methods on the public listener: PERMISSION_DENIED and a log line, not UNIMPLEMENTED,
    so a probe is visible and a misdirected operator learns where Admin lives."""
    methods = admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods
    handlers = {m.name: _refusal(f"/{ADMIN_SERVICE_NAME}/{m.name}",
                                 grpc.StatusCode.PERMISSION_DENIED,
                                 "the Admin API is not served on the public listener")
                for m in methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ADMIN_SERVICE_NAME, handlers),))


@dataclass(frozen=True)
class Listeners:
    """Where the scheduler listens: the public API and the Admin API."""

    public: str = "127.0.0.1:50051"
    admin: str = "127.0.0.1:50053"
    admin_token: str | None = None
    limits: RequestLimits = RequestLimits()
    # gRPC's own cap on a request, above the prompt limit (room for the other fields): a larger
    # message is refused by the transport before it is parsed.
    max_message_bytes: int = 4 * 1024 * 1024
    # the public port's connections; None: grpc on the TCP port itself, with no gate in front
    # (what benchmarks compare the gate with)
    gate: GateLimits | None = GateLimits()


class ListenError(RuntimeError):
    """A listener that cannot bind; `listener` says which ("public" or "admin")."""

    def __init__(self, listener: str, address: str) -> None:
        super().__init__(f"cannot listen on {address} (in use, or not an address here)")
        self.listener = listener


# Each listener's connection hygiene. Server pings find dead clients (a host that vanished
# holds its streams and a descriptor until then); a client may ping every 5 s, under every SDK's
# 10 s floor, with or without calls, and a ping flood ends its connection (two strikes). Idle
# connections (no call) close after 5 minutes: the client reconnects at its next call. There is
# no max connection age: it would cut a long Generate stream once its grace ran out.
_CONNECTION_OPTIONS = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet stream (queued request)
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.server_handshake_timeout_ms", 10_000),  # a connection that never speaks HTTP/2
    ("grpc.max_concurrent_streams", 2048),  # per connection; more wait at the client
)
_MAX_ADMIN_CONNECTIONS = 64


def _server(name: str, listen: str, max_receive: int, max_connections: int, interceptors=()):
    server = grpc.aio.server(interceptors=list(interceptors), options=[
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
        # beyond it a connection is closed at once: the process never runs out of descriptors
        ("grpc.max_allowed_incoming_connections", max_connections),
        *_CONNECTION_OPTIONS,
    ])
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as err:
        raise ListenError(name, listen) from err
    if port == 0:
        raise ListenError(name, listen)
    return server, port


class GatedServer:
    """The public grpc server on a unix socket in a private directory, behind the gate that owns
    the TCP port: started and stopped as one server."""

    def __init__(self, listen: str, max_receive: int, limits: GateLimits) -> None:
        self.socket_dir = PrivateSocketDir()
        self.gate = ConnectionGate(limits, self.socket_dir.socket_path)
        host, _, port = listen.rpartition(":")
        try:
            self.port = self.gate.listen(host, int(port))
            self.grpc, _ = _server("public", f"unix:{self.socket_dir.socket_path}", max_receive,
                                   limits.grpc_max_connections())
        except (OSError, ValueError, ListenError) as err:
            self.abandon()
            raise ListenError("public", listen) from err

    async def start(self) -> None:
        await self.grpc.start()
        await self.gate.start()

    async def stop(self, grace: float | None) -> None:
        """The gate stops accepting as grpc does; grpc's streams drain through it, then what is
        left of it (connections that never proved themselves) is closed."""
        self.gate.close()
        try:
            await self.grpc.stop(grace)
        finally:
            self.gate.close_all()
            self.socket_dir.remove()

    def abandon(self) -> None:
        """Lets go of the port and the directory of a server never started."""
        self.gate.close()
        self.socket_dir.remove()


def _public_server(listeners: Listeners):
    """(the server to start and stop, the grpc server to add services to, its port)."""
    if listeners.gate is None:
        server, port = _server("public", listeners.public, listeners.max_message_bytes,
                               GateLimits().max_connections)
        return server, server, port
    gated = GatedServer(listeners.public, listeners.max_message_bytes, listeners.gate)
    return gated, gated.grpc, gated.port


def build_servers(engine: Engine, listeners: Listeners):
    """(public server, admin server, health servicer, public port, admin port). Both listeners
    share the health servicer; reflection (v1 and v1alpha) describes only what each one serves."""
    health = HealthServicer()
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    public, services, public_port = _public_server(listeners)
    _add_generator(GeneratorServicer(engine, listeners.limits), services)
    _refuse_admin(services)
    health_pb2_grpc.add_HealthServicer_to_server(health, services)
    reflection.enable((SERVICE_NAME, health_name), services)
    interceptors = [_AdminToken(listeners.admin_token)] if listeners.admin_token else []
    try:
        admin, admin_port = _server("admin", listeners.admin, 1024 * 1024,
                                    _MAX_ADMIN_CONNECTIONS, interceptors)
    except ListenError:
        if isinstance(public, GatedServer):
            public.abandon()
        raise
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), admin)
    health_pb2_grpc.add_HealthServicer_to_server(health, admin)
    reflection.enable((ADMIN_SERVICE_NAME, health_name), admin)
    return public, admin, health, public_port, admin_port
