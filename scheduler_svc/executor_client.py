"""The scheduler's link to one executor: Describe, then one leased Execute stream of plans and
results (converted by `scheduler_svc.wire`). Every failure of the link surfaces as ExecutorLost.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from protos import executor_pb2, executor_pb2_grpc
from scheduler_svc import wire
from scheduler_svc.errors import ExecutorDisagreement
from scheduler_svc.plan import StepPlan, StepResult

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The executor welcomes pings down to every 0.5 s (executor_svc.server.SERVER_OPTIONS); a floor
# of twice that keeps clock jitter from ever earning a GOAWAY too_many_pings.
MIN_KEEPALIVE_S = 1.0
STARTUP_BACKOFF_S = 0.25  # the longest wait between rounds until the first attach (connect)
# Epochs of this process's lease hellos: every connect, of every client, gets a higher one, so a
# reconnect (or a switch back to the same executor) supersedes this scheduler's older stream.
_EPOCHS = itertools.count(1)


@functools.cache
def process_scheduler_id() -> str:
    """This scheduler process's lease identity: random, so two schedulers never share one."""
    return uuid.uuid4().hex


def channel_options(keepalive_s: float) -> list[tuple[str, int]]:
    if keepalive_s < MIN_KEEPALIVE_S:
        raise ValueError(f"keepalive_s must be >= {MIN_KEEPALIVE_S}, got {keepalive_s}")
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 5_000),
        # Keep pinging through idle spells (grpc stops after 2 pings without data by default):
        # a vanished executor is then found before the next step waits step_timeout_s for it.
        ("grpc.http2.max_pings_without_data", 0),
        # A keepalive ping that goes out while another ping is unanswered (the executor's own,
        # or a flow-control probe) waits under this timeout (a minute by default), not the
        # keepalive's: a frozen idle executor would go unnoticed that long.
        ("grpc.http2.ping_timeout_ms", 5_000),
    ]


class ExecutorLost(Exception):
    """The executor can no longer be trusted with this stream's state. `seq_ids` names the seqs
    whose own content caused it (their requests end, the others are recomputed); () if none."""

    def __init__(self, reason: str, seq_ids: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.seq_ids = tuple(seq_ids)


@dataclass(frozen=True)
class LinkSecurity:
    """TLS (a CA bundle to verify the executor), a shared token for the executor link, and
    whether to take the executor's lease from another live scheduler (honoured only by an
    executor with a token)."""

    tls_ca: str | None = None  # PEM file; None = plaintext
    tls_server_name: str | None = None  # overrides the name checked against the certificate
    auth_token: str | None = None
    takeover: bool = False

    def channel(self, address: str, options: list[tuple[str, int]]) -> grpc.aio.Channel:
        options = list(options)
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
    """Connects to the first answering executor among `addresses` whose model matches and that
    grants this scheduler its lease. `describe_timeout_s` bounds Describe and the lease hello's
    answer each; `keepalive_s` is the interval of the link's keepalive pings.

    Any failure of the link (broken stream, timeout, FAILED_PRECONDITION, a different model) is
    ExecutorLost; the engine resyncs and calls `connect()` again. An executor leased by another
    scheduler is skipped like one that does not answer. A stream that ends while the engine is
    idle, and a pass that every executor refused, are reported at once through the engine's
    hooks (`on_stream_end`, `on_refused`)."""

    def __init__(self, addresses: list[str], step_timeout_s: float = 60.0,
                 describe_timeout_s: float = 5.0, max_backoff_s: float = 2.0,
                 security: LinkSecurity = LinkSecurity(), fingerprint: str | None = None,
                 keepalive_s: float = 10.0, scheduler_id: str | None = None) -> None:
        if not addresses:
            raise ValueError("at least one executor address is needed")
        self.channel_options = channel_options(keepalive_s)
        self.keepalive_s = keepalive_s
        self.scheduler_id = scheduler_id or process_scheduler_id()
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
        self._last_refusal: str | None = None
        self._refusals: list[str] = []  # this pass's executors that refused this scheduler
        self._end_report: asyncio.Task | None = None
        self.disconnected_since: float | None = time.monotonic()
        # The engine's hooks for what happens while it awaits nothing of this link: the stream
        # ending (callable(reason)), and a pass over the addresses refused by every executor
        # that answered (callable(reason)); e.g. another scheduler took the executor's lease.
        self.on_stream_end = None
        self.on_refused = None

    async def connect(self) -> wire.ExecutorDescription:
        """Tries the addresses in turn, with backoff, until one answers; opens its Execute stream."""
        backoff = 0.05
        while True:
            description = await self.connect_once()
            if description is not None:
                return description
            if self._refusals and self.on_refused is not None:
                self.on_refused("; ".join(self._refusals))
            await asyncio.sleep(backoff)
            # Before the first attach the executor is most likely still loading beside us (both
            # started at once): serving starts within STARTUP_BACKOFF_S of its being ready, not
            # up to the whole retry interval later. A failed pass costs one refused connection.
            most = self.max_backoff_s if self.description is not None else min(
                self.max_backoff_s, STARTUP_BACKOFF_S)
            backoff = min(backoff * 2, most)

    async def connect_once(self) -> wire.ExecutorDescription | None:
        """One pass over the addresses; None if none answered with the right model."""
        self._refusals = []
        for address in self.addresses:
            description = await self._try_address(address)
            if description is not None:
                return description
        return None

    async def _try_address(self, address: str) -> wire.ExecutorDescription | None:
        await self.close()
        channel = self.security.channel(address, self.channel_options)
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
        refusal = self._refusal(description)
        if refusal is not None:
            log.error("refusing executor %s: %s", address, refusal)
            await channel.close()
            return None
        call = await self._open_leased_stream(stub, metadata, address)
        if call is None:
            await channel.close()
            return None
        self._log_attached(address, description)
        self.fingerprint = description.fingerprint
        self._channel, self._call = channel, call
        call.add_done_callback(self._on_call_done)
        self.description, self.connected_address = description, address
        self.disconnected_since, self._last_refusal = None, None
        return description

    def _refusal(self, description: wire.ExecutorDescription) -> str | None:
        """Why this scheduler cannot drive the executor that answered Describe so; None if it
        can."""
        if description.protocol_version != wire.PROTOCOL_VERSION:
            return (f"it speaks executor protocol version {description.protocol_version}, this "
                    f"scheduler version {wire.PROTOCOL_VERSION} (run one pagedserve release on "
                    "both)")
        if self.fingerprint is not None and description.fingerprint != self.fingerprint:
            return (f"it serves model {description.model_name} (fingerprint "
                    f"{description.fingerprint}), not fingerprint {self.fingerprint}")
        return None

    def _log_attached(self, address: str, description: wire.ExecutorDescription) -> None:
        """The attach line; before it, when the address attached last answers another instance
        id, a warning that the executor restarted (rather than only the link breaking)."""
        previous = self.description if address == self.connected_address else None
        if previous is not None and previous.instance_id != description.instance_id:
            log.warning("executor %s restarted (instance %016x, was %016x): it lost the state of "
                        "every sequence", address, description.instance_id, previous.instance_id)
        # "GPU blocks" would be wrong on the cpu backend: the pages are the backend device's.
        log.info("attached executor %s (%s, %s backend, %d KV pages (%s), %d CPU swap pages)",
                 address, description.model_name, description.backend,
                 description.num_gpu_blocks, description.backend, description.num_cpu_blocks)

    async def _open_leased_stream(self, stub, metadata, address: str):
        """Opens the Execute stream and presents the lease hello; the stream once the executor
        acknowledged it, None if it refused (leased by another scheduler) or did not answer."""
        call = stub.Execute(metadata=metadata)
        lease = executor_pb2.Lease(scheduler_id=self.scheduler_id, epoch=next(_EPOCHS),
                                   takeover=self.security.takeover,
                                   protocol_version=wire.PROTOCOL_VERSION)
        try:
            await asyncio.wait_for(call.write(executor_pb2.StepPlan(lease=lease)),
                                   self.describe_timeout_s)
            ack = await asyncio.wait_for(call.read(), self.describe_timeout_s)
        except asyncio.TimeoutError:
            ack = None
        except grpc.aio.AioRpcError as err:
            self._log_refusal(address, err)
            return None
        except Exception as err:  # noqa: BLE001 - the channel may break in other ways
            log.debug("executor %s: lease hello failed: %r", address, err)
            ack = None
        if ack is None or ack is grpc.aio.EOF or ack.step_id != 0:
            log.debug("executor %s did not acknowledge the lease hello: %r", address, ack)
            call.cancel()
            return None
        return call

    def _log_refusal(self, address: str, err: grpc.aio.AioRpcError) -> None:
        """A lease refusal goes to WARNING once while it repeats (connect() retries every few
        seconds while another scheduler holds the executor); other failures to DEBUG."""
        message = (f"executor {address} refused this scheduler's stream: {err.code().name}: "
                   f"{err.details()}")
        refused = err.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                 grpc.StatusCode.UNAUTHENTICATED)
        new = refused and message != self._last_refusal
        if refused:
            self._last_refusal = message
            self._refusals.append(message)
        log.log(logging.WARNING if new else logging.DEBUG, "%s", message)

    def _on_call_done(self, call) -> None:
        """The Execute stream ended while it was this link's: the executor died, restarted or
        gave the lease to another scheduler. Reported at once, though the engine may be idle and
        reading nothing (the keepalive pings end a silent link too)."""
        if call is self._call and self.on_stream_end is not None:
            self._end_report = asyncio.ensure_future(self._report_end(call))

    async def _report_end(self, call) -> None:
        code, details = await call.code(), await call.details()
        if call is self._call and self.on_stream_end is not None:
            self.on_stream_end(f"its Execute stream ended: {code.name}: {details}")

    async def send(self, plan: StepPlan) -> None:
        """Writes a plan to the Execute stream; its result is read by `receive`. A plan that some
        new seqs' own values keep off the wire gives the stream up (a step of it is missing now)
        as ExecutorLost naming them; one that no seq explains raises as it failed."""
        if self._call is None:
            raise ExecutorLost("no executor attached")
        try:
            message = wire.plan_to_proto(plan)
        except (ValueError, TypeError, OverflowError) as err:
            seq_ids = wire.unencodable_seq_ids(plan)
            if not seq_ids:
                raise
            raise self.lost(f"step {plan.step_id} cannot be encoded ({err}) because of seqs "
                            f"{seq_ids[:8]}", seq_ids) from err
        await self._guard(plan, self._call.write(message))

    async def receive(self, plan: StepPlan) -> StepResult:
        """The result of `plan`, already sent."""
        if self._call is None:
            raise ExecutorLost("no executor attached")
        result = await self._guard(plan, self._call.read())
        if result is grpc.aio.EOF:
            raise self.lost("executor closed the stream")
        if result.step_id != plan.step_id:
            raise self.lost(f"result for step {result.step_id}, expected {plan.step_id}")
        try:
            return wire.result_from_proto(result)
        except ExecutorDisagreement as err:
            raise self.lost(f"its result for step {plan.step_id} does not read: {err}") from err

    async def _guard(self, plan: StepPlan, operation):
        """Awaits a stream operation; every way it can fail becomes ExecutorLost. The deadline is
        a timer on this task (asyncio.timeout), not asyncio.wait_for's extra task, which cost every
        send and receive a task and a loop iteration on the step loop's critical path."""
        try:
            async with asyncio.timeout(self.step_timeout_s):
                return await operation
        except TimeoutError:
            raise self.lost(f"no result for step {plan.step_id} within {self.step_timeout_s}s")
        except grpc.aio.AioRpcError as err:
            raise self.lost(f"stream failed: {err.code().name}: {err.details()}",
                            wire.bad_seq_ids(err.trailing_metadata()))
        except Exception as err:  # the channel may break in ways grpc reports differently
            raise await self._lost_after(err)

    async def _lost_after(self, err: Exception) -> ExecutorLost:
        """ExecutorLost for a failed operation: a write to a stream the executor has ended
        raises without its status, which then says why (and which seqs caused it)."""
        call = self._call
        if call is None or not call.done():
            return self.lost(f"stream failed: {err!r}")
        code, details, metadata = (await call.code(), await call.details(),
                                   await call.trailing_metadata())
        return self.lost(f"stream failed: {code.name}: {details}", wire.bad_seq_ids(metadata))

    def with_addresses(self, addresses: list[str]) -> "ExecutorClient":
        """A client for other executors with this one's settings, lease identity and pinned
        fingerprint (a planned switch)."""
        return ExecutorClient(addresses, step_timeout_s=self.step_timeout_s,
                              describe_timeout_s=self.describe_timeout_s,
                              max_backoff_s=self.max_backoff_s, security=self.security,
                              fingerprint=self.fingerprint, keepalive_s=self.keepalive_s,
                              scheduler_id=self.scheduler_id)

    def lost(self, reason: str, seq_ids: tuple[int, ...] | list[int] = ()) -> ExecutorLost:
        """Marks the stream lost (since now) and returns the error to raise."""
        log.warning("executor %s lost: %s", self.connected_address, reason)
        self.disconnected_since = time.monotonic()
        self._call = None
        return ExecutorLost(reason, tuple(seq_ids))

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
