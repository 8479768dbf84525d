"""The scheduler's link to one executor: Describe, then one Execute stream of plans and results.

Wire module: converts plans and results with `scheduler_svc.wire`. Any failure of the link (broken
stream, timeout, FAILED_PRECONDITION, a different model) surfaces as ExecutorLost; the engine
resyncs and calls `connect()` again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from protos import executor_pb2, executor_pb2_grpc
from scheduler_svc import wire
from scheduler_svc.plan import StepPlan

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class ExecutorLost(Exception):
    """The executor can no longer be trusted with this stream's state."""


@dataclass(frozen=True)
class LinkSecurity:
    """TLS (a CA bundle to verify the executor) and a shared token for the executor link."""

    tls_ca: str | None = None  # PEM file; None = plaintext
    tls_server_name: str | None = None  # overrides the name checked against the certificate
    auth_token: str | None = None

    def channel(self, address: str) -> grpc.aio.Channel:
        options = list(_CHANNEL_OPTIONS)
        if self.tls_ca is None:
            return grpc.aio.insecure_channel(address, options=options)
        with open(self.tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.aio.secure_channel(address, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()


class ExecutorClient:
    """Connects to the first answering executor among `addresses` whose model matches."""

    def __init__(self, addresses: list[str], step_timeout_s: float = 60.0,
                 describe_timeout_s: float = 5.0, max_backoff_s: float = 2.0,
                 security: LinkSecurity = LinkSecurity(), fingerprint: str | None = None) -> None:
        if not addresses:
            raise ValueError("at least one executor address is needed")
        self.addresses = list(addresses)
        self.step_timeout_s = step_timeout_s
        self.describe_timeout_s = describe_timeout_s
        self.max_backoff_s = max_backoff_s
        self.security = security
        self.fingerprint = fingerprint  # pinned by the first executor we attach to
        self.description: wire.ExecutorDescription | None = None
        self.connected_address: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self.disconnected_since: float | None = time.monotonic()

    async def connect(self) -> wire.ExecutorDescription:
        """Tries the addresses in turn, with backoff, until one answers; opens its Execute stream."""
        backoff = 0.05
        while True:
            description = await self.connect_once()
            if description is not None:
                return description
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def connect_once(self) -> wire.ExecutorDescription | None:
        """One pass over the addresses; None if none answered with the right model."""
        for address in self.addresses:
            description = await self._try_address(address)
            if description is not None:
                return description
        return None

    async def _try_address(self, address: str) -> wire.ExecutorDescription | None:
        await self.close()
        channel = self.security.channel(address)
        stub = executor_pb2_grpc.ExecutorStub(channel)
        metadata = self.security.metadata()
        try:
            reply = await stub.Describe(executor_pb2.DescribeRequest(),
                                        timeout=self.describe_timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            level = logging.ERROR if err.code() == grpc.StatusCode.UNAUTHENTICATED else logging.DEBUG
            log.log(level, "executor %s did not answer Describe: %s %s", address, err.code().name,
                    err.details())
            await channel.close()
            return None
        description = wire.description_from_proto(reply)
        if self.fingerprint is not None and description.fingerprint != self.fingerprint:
            log.error("refusing executor %s: it serves model %s (fingerprint %s), not fingerprint %s",
                      address, description.model_name, description.fingerprint, self.fingerprint)
            await channel.close()
            return None
        self.fingerprint = description.fingerprint
        self._channel, self._call = channel, stub.Execute(metadata=metadata)
        self.description, self.connected_address = description, address
        self.disconnected_since = None
        log.info("attached executor %s (%s, %s backend, %d GPU / %d CPU blocks)", address,
                 description.model_name, description.backend, description.num_gpu_blocks,
                 description.num_cpu_blocks)
        return description

    async def send(self, plan: StepPlan) -> None:
        """Writes a plan to the Execute stream; its result is read by `receive`."""
        if self._call is None:
            raise ExecutorLost("no executor attached")
        await self._guard(plan, self._call.write(wire.plan_to_proto(plan)))

    async def receive(self, plan: StepPlan) -> dict[int, int]:
        """The result of `plan`, already sent: {seq_id: sampled token id}."""
        if self._call is None:
            raise ExecutorLost("no executor attached")
        result = await self._guard(plan, self._call.read())
        if result is grpc.aio.EOF:
            raise self._lost("executor closed the stream")
        if result.step_id != plan.step_id:
            raise self._lost(f"result for step {result.step_id}, expected {plan.step_id}")
        return wire.sampled_from_proto(result)

    async def _guard(self, plan: StepPlan, operation):
        """Awaits a stream operation; every way it can fail becomes ExecutorLost."""
        try:
            return await asyncio.wait_for(operation, self.step_timeout_s)
        except asyncio.TimeoutError:
            raise self._lost(f"no result for step {plan.step_id} within {self.step_timeout_s}s")
        except grpc.aio.AioRpcError as err:
            raise self._lost(f"stream failed: {err.code().name}: {err.details()}")
        except Exception as err:  # the channel may break in ways grpc reports differently
            raise self._lost(f"stream failed: {err!r}")

    def _lost(self, reason: str) -> ExecutorLost:
        log.warning("executor %s lost: %s", self.connected_address, reason)
        self.disconnected_since = time.monotonic()
        self._call = None
        return ExecutorLost(reason)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
