"""The public gRPC service: Generate (server streaming) and ModelInfo, plus health and reflection.

Thin servicers: message in, one engine call, messages out. Domain errors become status codes in
`_status_for` alone.
"""
from __future__ import annotations

import logging
import uuid

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from protos import admin_pb2, admin_pb2_grpc, generate_pb2, generate_pb2_grpc
from scheduler_svc import wire
from scheduler_svc.engine import Engine, NoExecutor, QueueFull, ShuttingDown
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.request import FinishEvent

log = logging.getLogger(__name__)

_STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoExecutor: grpc.StatusCode.UNAVAILABLE,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
}


def _status_for(err: Exception) -> grpc.StatusCode | None:
    for kind, code in _STATUS.items():
        if isinstance(err, kind):
            return code
    return None


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
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Generate(self, request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.reason}")
        request_id = request.request_id or uuid.uuid4().hex
        try:
            spec = wire.spec_from_proto(request)
            async for event in self.engine.generate(spec):
                if isinstance(event, FinishEvent):
                    yield wire.finish_to_proto(event, request_id)
                else:
                    yield wire.token_to_proto(event, request_id)
        except Exception as err:  # noqa: BLE001 - mapped or re-raised below
            code = _status_for(err)
            if code is None:
                raise
            await context.abort(code, str(err))

    async def ModelInfo(self, request, context):
        d = self.engine.client.description
        return generate_pb2.ModelInfoResponse(
            model_name=d.model_name,
            fingerprint=d.fingerprint,
            max_model_len=d.max_model_len,
            vocab_size=d.vocab_size,
            eos_token_id=self.engine.limits.eos_token_id or 0,
            dtype=d.dtype,
            block_size=d.block_size,
            num_gpu_blocks=d.num_gpu_blocks,
            num_cpu_blocks=d.num_cpu_blocks,
        )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def SetExecutors(self, request, context):
        addresses = [a.strip() for a in request.addresses if a.strip()]
        if not addresses:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "addresses: must not be empty")
        try:
            address, model_name, moved = await self.engine.switch_executor(addresses)
        except InvalidArgument as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return admin_pb2.SetExecutorsResponse(address=address, model_name=model_name,
                                              moved_sequences=moved)

    async def GetStatus(self, request, context):
        engine, scheduler = self.engine, self.engine.scheduler
        bm = scheduler.block_manager
        return admin_pb2.GetStatusResponse(
            executor_address=engine.client.connected_address or "",
            executor_attached=engine.attached,
            running=scheduler.num_running, waiting=scheduler.num_waiting,
            swapped=scheduler.num_swapped,
            gpu_blocks_used=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
            gpu_blocks_total=bm.num_gpu_blocks,
            cpu_blocks_used=bm.num_cpu_blocks - bm.num_free_cpu_blocks,
            cpu_blocks_total=bm.num_cpu_blocks,
            steps=engine.num_steps, resyncs=engine.num_resyncs, draining=engine.draining)


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


def build_server(engine: Engine, address: str, max_message_bytes: int = 64 * 1024 * 1024):
    """A grpc.aio server with the Generator, health and reflection services; returns (server, health)."""
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ])
    _add_generator(GeneratorServicer(engine), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    return server, health, port
