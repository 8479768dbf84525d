"""Which calls the executor's sync gRPC server gives a thread, and for how long a call may hold
one before its first message. Plain grpc: imports no executor code.
"""
from __future__ import annotations

import hmac
import itertools
import queue
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

TOKEN_METADATA_KEY = "authorization"

# How grpc's sync server (grpc/_server.py) spends threads, which this module is built on:
# - interceptors run on its one polling thread when a call's headers arrive, before any message;
# - a handler whose requests are a stream gets a pool thread at once and reads messages itself,
#   but a unary handler first waits in its pool thread for the message, with no time limit;
# - a behaviour with an `experimental_thread_pool` attribute runs on that pool, not the server's;
# - `maximum_concurrent_rpcs` counts every call of every method together.
# So the token is checked on the polling thread (a call without it is refused before its message);
# every method is served as request-streaming, its first message awaited with a deadline; each
# method has a pool of its own, apart for callers with the token, sized above the calls it lets
# wait (a newer call evicts one), so a newcomer always gets a thread; and there is no server-wide
# cap. What a stranger can hold: without the token, a few waiting calls per method for at most
# the deadline each, taken back as soon as a caller on a less crowded connection needs the slot
# (a scheduler's call comes with its message and waits on its own connection); with the token
# configured, only waiting calls of health and reflection, never a thread the scheduler's calls
# (which carry the token) run on.


class WaitingStreams:
    """Calls that have not sent their first message yet, at most `limit`. A new one beyond that
    closes (its `close()` callback) the oldest waiting call of the connection (`peer`) that has
    the most calls waiting, instead of being refused. A real client sends its first message with
    its headers, so idle calls opened in a loop can never keep it out: they push out each other,
    and a connection waiting for one message only when every connection waits for no more."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._waiting: OrderedDict[object, tuple[str, Callable[[], None]]] = OrderedDict()

    def add(self, close: Callable[[], None], peer: str = "") -> object:
        """Registers a waiting call of connection `peer`; returns its key for `remove`."""
        key = object()
        with self._lock:
            self._waiting[key] = (peer, close)
            evicted = self._pop_evictee() if len(self._waiting) > self.limit else None
        if evicted is not None:
            evicted()
        return key

    def _pop_evictee(self) -> Callable[[], None]:
        counts = Counter(peer for peer, _ in self._waiting.values())
        most = max(counts.values())
        key = next(k for k, (peer, _) in self._waiting.items() if counts[peer] == most)
        return self._waiting.pop(key)[1]

    def remove(self, key: object) -> bool:
        """Ends a call's wait; False if it was evicted (its close() has been or is being called)."""
        with self._lock:
            return self._waiting.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)


@dataclass(frozen=True)
class MethodLimits:
    """A method's share of threads. `max_waiting` calls may wait for their first message (beyond,
    a newer one evicts one: WaitingStreams); `max_open` calls may run past it (None: the method answers at once,
    so none stays); `reads_first`: the servicer awaits the first message itself (Execute's hello,
    with its own deadline and WaitingStreams)."""

    max_waiting: int
    max_open: int | None = None
    reads_first: bool = False

    @property
    def threads(self) -> int:
        # Above every call that can stay, so a newcomer always finds a thread to evict from.
        return self.max_waiting + (self.max_open or 0) + 4


class Evicted(Exception):
    """A newer call took this call's place among the calls waiting for their first message."""


class _FirstMessage:
    """Reads one message of a call in a thread of its own (grpc's iterator has no timeout), so the
    call's handler can wait for it with a deadline and be interrupted. The thread ends with the
    call at the latest."""

    def __init__(self, requests) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(requests,), daemon=True,
                         name="first-message").start()

    def _read(self, requests) -> None:
        try:
            self._inbox.put(next(requests, None))
        except BaseException as err:  # the call ended (cancelled): the handler raises it
            self._inbox.put(err)

    def interrupt(self) -> None:
        self._inbox.put(Evicted())

    def get(self, timeout: float):
        """The message; None if the call half-closed without one. Raises TimeoutError after
        `timeout`, Evicted, or the call's error."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if isinstance(item, BaseException):
            raise item
        return item


def await_first(waiting: WaitingStreams, context, get, interrupt, timeout_s: float, what: str,
                callers: str):
    """A call's first message from `get(timeout)` while the call is registered in `waiting`
    (`interrupt()` makes `get` raise Evicted); aborts the call if none comes within `timeout_s`
    (`get` raises TimeoutError), a newer call evicts it, or the call breaks."""
    key = waiting.add(interrupt, context.peer())
    try:
        message = get(timeout_s)
    except TimeoutError:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"no {what} within {timeout_s:g}s of the call's start")
    except Evicted:
        message = None
    except Exception:  # noqa: BLE001 - the call broke (cancelled): nothing to answer
        context.abort(grpc.StatusCode.CANCELLED, f"the call ended before its {what}")
    finally:
        evicted = not waiting.remove(key)
    if evicted:  # even if the message came as it was evicted: its Evicted is in the inbox
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"too many {callers} are waiting for their {what}")
    return message


class MethodSlots:
    """One method's pool (for callers with or without the token): its threads, the calls waiting
    for their first message, and the calls open past it."""

    def __init__(self, method: str, limits: MethodLimits, first_message_timeout_s: float) -> None:
        self.method = method
        self.limits = limits
        self.timeout_s = first_message_timeout_s
        self.pool = futures.ThreadPoolExecutor(limits.threads, thread_name_prefix="rpc")
        self.waiting = WaitingStreams(limits.max_waiting)
        self._open = threading.BoundedSemaphore(limits.max_open) if limits.max_open else None

    def first_message(self, requests, context):
        """The call's first message (None if it had none); ends the call if none comes within the
        deadline, a newer call evicts it, or the client leaves."""
        reader = _FirstMessage(requests)
        return await_first(self.waiting, context, reader.get, reader.interrupt, self.timeout_s,
                           "request message", f"{self.method} calls")

    def enter(self, context) -> None:
        """Counts a call past its first message against max_open; refuses it beyond."""
        if self._open is not None and not self._open.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too many open {self.method} calls; try again when one ends")

    def leave(self) -> None:
        if self._open is not None:
            self._open.release()


class CallSlots(grpc.ServerInterceptor):
    """Serves each call on its method's pool (`limits`, `default` for methods not listed), apart
    for callers that present `token`; a call to a method under `guarded_prefix` without the token
    is refused before its message is read (UNAUTHENTICATED)."""

    def __init__(self, limits: dict[str, MethodLimits], default: MethodLimits,
                 first_message_timeout_s: float, token: str | None = None,
                 guarded_prefix: str = "") -> None:
        self._limits, self._default = limits, default
        self._timeout_s = first_message_timeout_s
        self._expected = f"Bearer {token}".encode() if token else None
        self._guarded_prefix = guarded_prefix
        self._handlers: dict[tuple[str, bool], grpc.RpcMethodHandler] = {}
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED without a thread
        authenticated = self._authenticated(handler_call_details.invocation_metadata)
        if self._expected and not authenticated and method.startswith(self._guarded_prefix):
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong executor token")
        key = (method, authenticated)
        wrapped = self._handlers.get(key)
        if wrapped is None:
            with self._lock:
                wrapped = self._handlers.get(key)
                if wrapped is None:
                    slots = MethodSlots(method, self._limits.get(method, self._default),
                                        self._timeout_s)
                    wrapped = self._handlers[key] = _on_slots(handler, slots)
        return wrapped

    def _authenticated(self, metadata) -> bool:
        if self._expected is None:
            return False
        given = next((v for k, v in metadata or () if k == TOKEN_METADATA_KEY), "")
        given = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given, self._expected)


def _on_slots(handler: grpc.RpcMethodHandler, slots: MethodSlots) -> grpc.RpcMethodHandler:
    """`handler` as a request-streaming handler on `slots`' pool, awaiting its first message
    under `slots`' rules."""
    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                or handler.stream_stream)
    unary_request = not handler.request_streaming

    def argument(requests, context):
        if slots.limits.reads_first:
            return requests
        first = slots.first_message(requests, context)
        if unary_request:
            if first is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{slots.method} takes exactly one request message")
            return first
        return requests if first is None else itertools.chain((first,), requests)

    if getattr(behavior, "experimental_non_blocking", False):  # health Watch: no thread held
        def serve(requests, context, send_response):
            return behavior(argument(requests, context), context, send_response)
        serve.experimental_non_blocking = True
    elif handler.response_streaming:
        def serve(requests, context):
            request = argument(requests, context)
            slots.enter(context)
            try:
                yield from behavior(request, context)
            finally:
                slots.leave()
    else:
        def serve(requests, context):
            return behavior(argument(requests, context), context)
    serve.experimental_thread_pool = slots.pool
    make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler)
    return make(serve, handler.request_deserializer, handler.response_serializer)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
             details: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` without reading a message (on the server's own
    pool, for a moment)."""
    def refuse(requests, context):
        context.abort(code, details)

    if handler.response_streaming:
        def refuse_stream(requests, context):
            refuse(requests, context)
            yield  # a generator, as grpc expects of a response stream
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)
