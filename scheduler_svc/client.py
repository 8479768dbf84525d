"""`pagedserve-client`: a command-line client of the public Generate API that streams text to stdout."""
from __future__ import annotations

import argparse
import sys

import grpc

from protos import generate_pb2, generate_pb2_grpc


def build_request(a: argparse.Namespace) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(request_id=a.request_id or "")
    if a.token_ids:
        req.token_ids.ids.extend(int(x) for x in a.prompt.split(","))
    elif a.raw:
        req.text = a.prompt
    else:
        if a.system:
            req.chat.messages.add(role="system", content=a.system)
        req.chat.messages.add(role="user", content=a.prompt)
    req.sampling.temperature = a.temperature
    if a.top_p is not None:
        req.sampling.top_p = a.top_p
    req.sampling.top_k = a.top_k
    req.sampling.min_p = a.min_p
    if a.seed is not None:
        req.sampling.seed = a.seed
    req.stopping.max_tokens = a.max_tokens
    req.stopping.stop.extend(a.stop or [])
    req.stopping.ignore_eos = a.ignore_eos
    return req


def check_health(address: str, timeout: float) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-client", description=__doc__)
    p.add_argument("prompt", help="the prompt (a user chat message unless --raw or --token-ids)")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    p.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    p.add_argument("--system", default=None, help="a system message to put first")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--show-ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--request-id", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--health", action="store_true",
                   help="only check the server's grpc.health.v1 status (exit 0 when SERVING)")
    a = p.parse_args(argv)
    if a.health:
        return check_health(a.address, min(a.timeout, 5.0))
    with grpc.insecure_channel(a.address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        try:
            for msg in stub.Generate(build_request(a), timeout=a.timeout):
                if msg.finished:
                    sys.stdout.write(msg.text)
                    reason = generate_pb2.FinishReason.Name(msg.finish_reason)
                    print(f"\n[{reason}, {msg.prompt_tokens} prompt + "
                          f"{msg.completion_tokens} completion tokens]", file=sys.stderr)
                elif a.show_ids:
                    sys.stdout.write(f"{msg.token_id} ")
                else:
                    sys.stdout.write(msg.text)
                sys.stdout.flush()
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
