"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1` (current grpcurl
and grpc tools) and `grpc.reflection.v1alpha` (older clients). Imports no service code.
"""
from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
# The one method of both services, as a full method path (what stream limits are keyed by).
METHODS = tuple(f"/{name}/ServerReflectionInfo" for name in SERVICE_NAMES)
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable(service_names, server) -> None:
    """Serves reflection for `service_names` (and itself, v1 and v1alpha) on a grpc.Server or a
    grpc.aio.Server, before it starts."""
    add_v1_file()
    names = (*service_names, *SERVICE_NAMES)
    if isinstance(server, grpc.aio.Server):
        servicer = reflection.aio.ReflectionServicer(names)
    else:
        servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),))


def add_v1_file() -> None:
    """Adds grpc/reflection/v1/reflection.proto to the default pool, once: v1alpha's file with
    its package (and the type names that carry it) renamed. grpcio-reflection ships only
    v1alpha; v1's messages are v1alpha's field for field, so v1alpha's servicer answers v1 calls
    too, and this file lets a client describe the v1 service itself."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old = f".{file.package}."
    file.name, file.package = _V1_FILE, V1_PACKAGE
    file.ClearField("options")  # v1alpha's Java/Objective-C package names
    for message in file.message_type:
        for f in message.field:
            if f.type_name:  # set only on message and enum fields
                f.type_name = f.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in file.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    pool.Add(file)
