"""Server reflection as current grpcurl asks for it (grpc.reflection.v1) and as older clients do
(v1alpha), on the scheduler's two listeners and on the executor, in-process."""
import asyncio

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from executor_svc.server import build_server
from protos import reflection
from scheduler_svc.server import Listeners, build_servers

HEALTH = "grpc.health.v1.Health"


def v1_call(channel: grpc.Channel, **request) -> list:
    """One v1 ServerReflectionInfo exchange, with v1's own message types (what grpcurl sends)."""
    reflection.add_v1_file()
    pool = descriptor_pool.Default()
    request_type = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    response_type = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    info = channel.stream_stream(f"/{reflection.V1_SERVICE_NAME}/ServerReflectionInfo",
                                 request_serializer=request_type.SerializeToString,
                                 response_deserializer=response_type.FromString)
    return list(info(iter([request_type(**request)]), timeout=10))


def v1_services(channel: grpc.Channel) -> set[str]:
    [reply] = v1_call(channel, list_services="")
    return {s.name for s in reply.list_services_response.service}


def v1_file_of(channel: grpc.Channel, symbol: str) -> descriptor_pb2.FileDescriptorProto:
    [reply] = v1_call(channel, file_containing_symbol=symbol)
    assert not reply.HasField("error_response"), reply.error_response
    return descriptor_pb2.FileDescriptorProto.FromString(
        reply.file_descriptor_response.file_descriptor_proto[0])


def check_listener(address: str, served: str, not_served: tuple[str, ...] = ()) -> None:
    with grpc.insecure_channel(address) as channel:
        services = v1_services(channel)
        assert {served, HEALTH, *reflection.SERVICE_NAMES} <= services
        assert not services & set(not_served)
        assert served.rsplit(".", 1)[1] in [s.name for s in v1_file_of(channel, served).service]
        assert v1_file_of(channel, reflection.V1_SERVICE_NAME).package == "grpc.reflection.v1"
        assert served in ProtoReflectionDescriptorDatabase(channel).get_services()  # v1alpha


def test_the_scheduler_listeners_answer_v1_and_v1alpha():
    async def scenario():
        public, admin, _, port, admin_port = build_servers(
            object(), Listeners(public="127.0.0.1:0", admin="127.0.0.1:0"))
        await public.start()
        await admin.start()
        try:
            await asyncio.to_thread(check_listener, f"127.0.0.1:{port}", "pagedserve.v1.Generator",
                                    ("pagedserve.v1.Admin",))
            await asyncio.to_thread(check_listener, f"127.0.0.1:{admin_port}",
                                    "pagedserve.v1.Admin", ("pagedserve.v1.Generator",))
        finally:
            await public.stop(None)
            await admin.stop(None)
    asyncio.run(scenario())


def test_the_executor_answers_v1_and_v1alpha():
    server, port = build_server(object(), "127.0.0.1:0")
    server.start()
    try:
        check_listener(f"127.0.0.1:{port}", "pagedserve.v1.Executor")
    finally:
        server.stop(None)
