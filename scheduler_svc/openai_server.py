"""The OpenAI-compatible HTTP API (`--http-port`) on Starlette and uvicorn in the scheduler's event
loop, over the same Engine as Generate (one admission path, one set of limits). No gRPC, no torch.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from scheduler_svc import openai_protocol as protocol
from scheduler_svc.admission import NoExecutor, QueueFull, ShuttingDown
from scheduler_svc.body_parser import BodyParser, ParsedBody, ParserUnavailable
from scheduler_svc.engine import Engine
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.fanout import Fanout
from scheduler_svc.http_protocol import BoundedHttpToolsProtocol, HttpLimits, throttle_accept_errors
from scheduler_svc.output import EngineFailed
from scheduler_svc.request import check_request_id

log = logging.getLogger(__name__)

# (status, OpenAI error type) per domain error
_STATUS = {
    InvalidArgument: (400, "invalid_request_error"),
    QueueFull: (429, "rate_limit_error"),
    NoExecutor: (503, "service_unavailable_error"),
    ShuttingDown: (503, "service_unavailable_error"),
    EngineFailed: (500, "server_error"),
    ParserUnavailable: (503, "service_unavailable_error"),
}
# The status nginx logs for a client that closed its connection; nobody receives it.
_CLIENT_GONE = 499
_KERNEL_BACKLOG = 2048  # uvicorn's default
# Error messages echo client values (a model name, a path): clipped, so that an answer stays small
# whatever the request held.
MAX_MESSAGE_CHARS = 1024
_MAX_ECHO_CHARS = 128


@dataclass(frozen=True)
class OpenAIConfig:
    api_key: str | None = None
    # --served-model-name: the first is reported; empty: the attached executor's model name
    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = 3 * 1024 * 1024
    limits: HttpLimits = HttpLimits()
    # --tool-call-parser: how tool_choice "auto" finds the calls the model wrote, taken only with
    # --enable-auto-tool-choice (vLLM's flags; "required" and named choices need neither)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)

    def response(self) -> JSONResponse:
        param = None if self.param is None else clip(self.param, _MAX_ECHO_CHARS)
        return JSONResponse({"error": {"message": clip(self.message, MAX_MESSAGE_CHARS),
                                       "type": self.type, "param": param, "code": self.code}},
                            self.status)


def clip(text: str, limit: int = _MAX_ECHO_CHARS) -> str:
    """`text`, cut to `limit` characters (an ellipsis and the full length said) if longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class _ClientGone(Exception):
    """The client closed its connection before the response was ready."""


@dataclass(frozen=True)
class _Endpoint:
    """What differs between /v1/chat/completions and /v1/completions."""

    kind: str  # of body_parser.parse
    format: type


_CHAT = _Endpoint("chat", protocol.ChatFormat)
_COMPLETIONS = _Endpoint("completions", protocol.CompletionFormat)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the scheduler's main owns SIGINT and
    SIGTERM (it drains first, then stops every listener)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets=None) -> None:
        """asyncio accepts up to `backlog` connections at a wakeup, all before the connection cap
        counts them, and passes the same number to listen(): a small one bounds the descriptors
        the cap cannot see; the kernel's queue is then set back to a large one, so that a burst
        of clients is queued, not dropped."""
        await super().startup(sockets)
        for sock in sockets or ():
            sock.listen(_KERNEL_BACKLOG)


class OpenAIServer:
    """The Starlette app and its uvicorn server; `start` binds, `stop` drains and closes."""

    def __init__(self, engine: Engine, config: OpenAIConfig, registry) -> None:
        self.engine = engine
        self.config = config
        self.registry = registry
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._v1(self._chat), methods=["POST"]),
            Route("/v1/completions", self._v1(self._completions), methods=["POST"]),
            Route("/v1/models", self._v1(self._models), methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_exception})
        self._server: _Server | None = None
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._texts: protocol.TokenTexts | None = None
        self.body_parser = BodyParser(engine.config.limits)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: any free port); returns the port. Raises RuntimeError
        "cannot listen on ..." as the gRPC listeners do."""
        try:
            self._socket = socket.create_server((host.strip("[]"), port), family=_family(host))
        except OSError as err:
            raise RuntimeError(f"cannot listen on {host}:{port} (in use, or not an address "
                               f"here): {os.strerror(err.errno) if err.errno else err}") from err
        # lifespan off and no log config: the scheduler owns logging; no access log (requests
        # are logged by the engine at DEBUG); no WebSocket route, so no WebSocket protocol
        limits = self.config.limits
        protocol = functools.partial(BoundedHttpToolsProtocol, limits=limits)
        self._server = _Server(uvicorn.Config(
            self.app, http=protocol, ws="none", lifespan="off", log_config=None,
            access_log=False, timeout_graceful_shutdown=5, backlog=limits.accept_batch,
            timeout_keep_alive=limits.keep_alive_timeout_s))
        throttle_accept_errors(asyncio.get_running_loop())
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]),
                                         name="http-server")
        self._task.add_done_callback(self._on_server_end)
        await self.body_parser.start()
        return self._socket.getsockname()[1]

    def _on_server_end(self, task: asyncio.Task) -> None:
        """The HTTP server must end only when asked to: anything else is logged loudly."""
        if task.cancelled() or self._server.should_exit and task.exception() is None:
            return
        log.error("the HTTP API stopped serving unexpectedly", exc_info=task.exception())

    async def stop(self) -> None:
        """Stops listening, lets running responses end (up to 5 s), then closes."""
        if self._server is not None:
            self._server.should_exit = True
            await self._task
        await self.body_parser.stop()

    # --- routes ---------------------------------------------------------------------------------

    def _v1(self, handler):
        """The API key check and the error mapping of every /v1 route."""
        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request)
                return await handler(request)
            except Exception as err:  # noqa: BLE001 - every error gets a status, none a trace
                return self._error_response(err, request)
        return endpoint

    def _authorize(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (authorization: Bearer ...)",
                           code="invalid_api_key")

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, _CHAT)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, _COMPLETIONS)

    async def _models(self, request: Request) -> Response:
        names = self._model_names()
        if names is None:
            raise NoExecutor("no executor attached yet: the model is not known")
        model = self._model_keys()
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "pagedserve",
             "root": name, **model} for name in names]})

    async def _health(self, request: Request) -> Response:
        """200 while an executor is attached and the server is not draining, else 503."""
        if self.engine.attached and not self.engine.draining:
            return Response(status_code=200)
        return ApiError(503, "not serving: " + ("draining" if self.engine.draining
                                                 else "no executor attached"),
                        "service_unavailable_error").response()

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # --- generation -----------------------------------------------------------------------------

    async def _generate(self, request: Request, endpoint: _Endpoint) -> Response:
        request_id = _request_id(request)
        parsed = await self._parse(request, endpoint.kind, request_id)
        body = parsed.body
        try:
            fanout, model, tools = await self._start(request, parsed)
        except InvalidArgument as err:
            raise _bad_parameter(err, body) from None
        if body.user:
            log.debug("request %s from user %r", request_id, body.user[:64])
        texts = self._token_texts() if body.num_logprobs() is not None else None
        reply = protocol.Reply.new(endpoint.format.id_prefix, request_id, model, texts, tools)
        if body.stream:
            return StreamingResponse(_events(fanout, endpoint.format, reply, body),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(fanout.close))
        try:
            choices = await _unless_disconnected(request, _collect(fanout, reply))
        finally:
            await fanout.close()
        return JSONResponse(endpoint.format.response(reply, choices, body.n))

    async def _start(self, request: Request, parsed: ParsedBody
                     ) -> tuple[Fanout, str, protocol.ToolCalling | None]:
        """Admits the engine requests of the body and waits for their first tokens, so that a
        refusal is still a status code; returns them, the model name to report and how the
        output is read for tool calls."""
        body = parsed.body
        names = self._model_names()
        if names is not None:
            _check_model(body.model, names)
        if parsed.refusal is not None:
            raise InvalidArgument(*parsed.refusal)
        auto_parser = self.config.tool_call_parser if self.config.enable_auto_tool_choice else None
        tools = protocol.tool_calling(body, auto_parser)
        fanout = Fanout(self.engine, _with_deadline(parsed.specs, request))
        try:
            await _unless_disconnected(request, fanout.started())
            if names is None:  # no executor had attached: its model is known now
                names = self._model_names() or ()
                _check_model(body.model, names)
        except BaseException:
            await fanout.close()
            raise
        return fanout, body.model or (names[0] if names else ""), tools

    def _token_texts(self) -> protocol.TokenTexts:
        """The texts of the attached model's tokens, kept while its tokenizer is the same."""
        tokenizer = self.engine.tokenizer
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = protocol.TokenTexts(tokenizer)
        return self._texts

    async def _parse(self, request: Request, kind: str, request_id: str) -> ParsedBody:
        """The body read and parsed (a large one in a child process: body_parser); a 400 if it is
        not a request at all."""
        _check_json(request)
        data = await _read_body(request, self.config.max_body_bytes)
        parsed = await self.body_parser.parse(kind, data, request_id)
        if parsed.invalid is not None:
            raise _invalid(*parsed.invalid)
        protocol.warn_ignored(parsed.ignored)
        return parsed

    def _model_names(self) -> tuple[str, ...] | None:
        """--served-model-name, else the attached executor's model name (which it derives from
        its model path, as vLLM does); None while neither is known."""
        if self.config.served_model_names:
            return self.config.served_model_names
        try:
            return (self.engine.model_info().model_name,)
        except NoExecutor:
            return None

    def model_name(self) -> str:
        """The reported model name; "" while none is known."""
        names = self._model_names()
        return names[0] if names else ""

    def _model_keys(self) -> dict:
        """/v1/models' keys beyond OpenAI's, as vLLM adds max_model_len: the attached model's
        length, quantization ("" for dense weights) and KV cache dtype (None: none attached)."""
        try:
            m = self.engine.model_info()
        except NoExecutor:
            return {"max_model_len": None, "quantization": None, "kv_cache_dtype": None}
        return {"max_model_len": m.max_model_len, "quantization": m.quantization,
                "kv_cache_dtype": m.kv_cache_dtype}

    def _error_response(self, err: Exception, request: Request) -> Response:
        """The one place domain errors become OpenAI error bodies (the parameter renamed as the
        API calls it by `_bad_parameter`); once a stream has started they are an error event."""
        if isinstance(err, _ClientGone):
            log.debug("%s %s: the client went away; its request was cancelled",
                      request.method, request.url.path)
            return Response(status_code=_CLIENT_GONE)
        if isinstance(err, ApiError):
            return err.response()
        for kind, (status, type_) in _STATUS.items():
            if isinstance(err, kind):
                response = ApiError(status, str(err), type_,
                                    getattr(err, "field", None)).response()
                # OpenAI's SDKs retry after it (up to 60 s)
                if isinstance(err, (QueueFull, ParserUnavailable)):
                    response.headers["Retry-After"] = str(err.retry_after_s)
                return response
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        return ApiError(500, "internal error; the scheduler's log has the details",
                        "server_error").response()


def _with_deadline(specs: list, request: Request) -> list:
    """The specs with the client's deadline, where it sends one: OpenAI's SDKs send their read
    timeout, by which the first byte of the answer must come (x-stainless-read-timeout)."""
    try:
        timeout = float(request.headers.get("x-stainless-read-timeout", "nan"))
    except ValueError:
        return specs
    if not 0 < timeout < math.inf:
        return specs
    deadline = time.monotonic() + timeout
    return [dataclasses.replace(spec, deadline=deadline) for spec in specs]


def _bad_parameter(err: InvalidArgument, body) -> ApiError:
    """The engine's InvalidArgument as a 400 naming the parameter as the API calls it."""
    param = protocol.param_name(err.field, body)
    reason = err.message.removeprefix(f"{err.field}: ")
    return ApiError(400, f"{param}: {reason}", param=param)


def _check_model(model: str | None, names: tuple[str, ...]) -> None:
    if model is not None and names and model not in names:
        raise ApiError(404, f"the model {clip(model)!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in names)}", param="model",
                       code="model_not_found")


def _check_json(request: Request) -> None:
    """A JSON body only (415 otherwise): a browser posts a form, or text/plain, cross-site
    without asking first; it must ask (a CORS preflight) before it can send application/json."""
    given = request.headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != "application/json":
        got = repr(clip(given)) if given else "none"
        raise ApiError(415, f"the body must be JSON, sent with content-type: application/json "
                       f"(got {got})")


def _request_id(request: Request) -> str:
    """The client's X-Request-Id if it is a valid request id, else a fresh one."""
    given = request.headers.get("x-request-id")
    if given:
        try:
            check_request_id(given)
            return given
        except InvalidArgument:
            pass
    return uuid.uuid4().hex


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes before any more is read."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body has {length} bytes; at most {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # mid-upload: nobody to answer, nothing went wrong here
        raise _ClientGone() from None
    return b"".join(chunks)


def _invalid(type_: str, loc: tuple, message: str) -> ApiError:
    """Pydantic's first error as a 400 naming the parameter (`messages[0].role`)."""
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    param = clip(param.lstrip(".")) or None  # a dict key (logit_bias) is the client's
    if type_ == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {message}")
    return ApiError(400, f"{param}: {message}", param=param)


async def _unless_disconnected(request: Request, work):
    """Awaits `work`, cancelling it and raising _ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        for pending in (task, watch):
            pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(fanout: Fanout, reply: protocol.Reply) -> list[protocol.Choice]:
    choices = [reply.new_choice() for _ in range(fanout.num_choices)]
    async for index, event in fanout.events():
        protocol.apply(choices[index], event)
    return choices


def _sse(data) -> str:
    """One server-sent event: a single `data:` line (JSON never holds a raw newline)."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _events(fanout: Fanout, fmt, reply: protocol.Reply, body):
    """The stream: each choice's opening chunk, a chunk per token (as vLLM's: its text may be
    empty, e.g. half a character or text held back for a stop string; its logprobs, if asked
    for, are there) and one with its finish reason, the usage chunk if asked for, then [DONE].
    An error after the first chunk is sent as an error event. On disconnect Starlette cancels
    this generator, which aborts the requests; the response's background task waits until they
    are gone."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    choices = [reply.new_choice() for _ in range(fanout.num_choices)]
    usage_field = {"usage": None} if include_usage else {}
    try:
        for index in range(len(choices)):
            opening = fmt.opening(reply, index)
            if opening is not None:
                yield _sse({**opening, **usage_field})
        async for index, event in fanout.events():  # a chunk per token, its text maybe empty
            delta = protocol.apply(choices[index], event)
            chunk = fmt.chunk(reply, index, delta, choices[index].finish_reason)
            yield _sse({**chunk, **usage_field})
        if include_usage:
            yield _sse(fmt.usage_chunk(reply, choices, body.n))
    except Exception as err:  # noqa: BLE001 - the status line is sent: an error event instead
        status, type_ = next((v for k, v in _STATUS.items() if isinstance(err, k)),
                             (500, "server_error"))
        if status == 500 and not isinstance(err, EngineFailed):
            log.error("stream %s failed", reply.id, exc_info=err)
        yield _sse({"error": {"message": clip(str(err), MAX_MESSAGE_CHARS), "type": type_,
                              "param": None, "code": status}})
    finally:
        fanout.cancel()  # however the stream ends; the response's background task awaits it
    yield _sse("[DONE]")


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405 in OpenAI's error shape."""
    message = f"{request.method} {clip(request.url.path)}: {exc.detail}"
    return ApiError(exc.status_code, message).response()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
