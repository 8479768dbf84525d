"""The OpenAI API's request bodies parsed into GenerateSpecs: small ones inline, large ones in child
processes, since pydantic holds the GIL for a whole parse and would stall the event loop both APIs
share. No HTTP, no gRPC, no torch.
"""
from __future__ import annotations

import asyncio
import io
import logging
import os
import pickle
import struct
import sys
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

import scheduler_svc
from scheduler_svc import openai_protocol as protocol
from scheduler_svc.errors import InvalidArgument
from scheduler_svc.request import GenerateSpec, RequestLimits, check_sizes
from scheduler_svc.sampling_params import MAX_UINT32

log = logging.getLogger(__name__)

# A body up to this size is parsed inline: whatever its shape (the slowest: thousands of tiny
# lists or objects), pydantic then holds the GIL for a few milliseconds at most.
INLINE_PARSE_BYTES = 16 * 1024
# A list longer than this comes back from a child in chunks, one unpickled per loop turn.
_CHUNK = 8192
_LENGTH = struct.Struct("!Q")
_KINDS = {"chat": (protocol.ChatCompletionRequest, protocol.chat_specs),
          "completions": (protocol.CompletionRequest, protocol.completion_specs)}
# What the specs carry, or what nothing reads once they are made: left out of the parsed body,
# whose size then does not grow with the request's.
_CARRIED_BY_SPECS = frozenset({"messages", "prompt", "stop", "stop_token_ids", "logit_bias",
                               "tools", "functions", "response_format"})
_DROPPED = {model: dict.fromkeys(_CARRIED_BY_SPECS & model.model_fields.keys())
            for model, _ in _KINDS.values()}
_CHILD_CODE = "from scheduler_svc.body_parser import child_main; child_main()"


class ParserUnavailable(Exception):
    """No child could parse the body: all busy with a full queue, the one parsing it died or hung,
    or the server is stopping. Mapped to 503 with Retry-After."""

    retry_after_s = 1

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}; retry in {self.retry_after_s}s")


@dataclass(frozen=True)
class ParsedBody:
    """A parsed body. `invalid` (pydantic's first error: type, loc, msg) if it is not a request of
    its endpoint; else `body` (its fields, those `_CARRIED_BY_SPECS` None, unknown ones left
    out) and either `specs` or `refusal` (the field and reason of an InvalidArgument, which the
    server raises after its model check), and the unknown fields it ignores."""

    body: BaseModel | None = None
    specs: list[GenerateSpec] | None = None
    refusal: tuple[str, str] | None = None
    invalid: tuple[str, tuple, str] | None = None
    ignored: tuple[str, ...] = ()


def parse(kind: str, data: bytes, request_id: str, limits: RequestLimits) -> ParsedBody:
    """The one parse of a body of `kind` ("chat" or "completions"), inline or in a child: pydantic,
    then every refusal that needs neither the model nor the tokenizer (unsupported fields, the
    engine's size and range limits), so that what it returns is bounded by those limits."""
    model, make_specs = _KINDS[kind]
    try:
        req = model.model_validate_json(data)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        return ParsedBody(invalid=(first["type"], tuple(first["loc"]), first["msg"]))
    body = _slim(req)
    try:
        specs = make_specs(req, request_id)
        for spec in specs:
            check_sizes(spec, limits)
            spec.sampling.validate()
            # the vocabulary is the engine's to check: here stop ids only within the wire's bound
            spec.stopping.validate(MAX_UINT32 + 1)
    except InvalidArgument as err:
        return ParsedBody(body, refusal=(err.field, err.message.removeprefix(f"{err.field}: ")))
    return ParsedBody(body, specs, ignored=tuple(protocol.ignored_fields(req)))


def _slim(req: BaseModel) -> BaseModel:
    """`req` with the fields the specs carry set to None, and without unknown fields."""
    update = dict(_DROPPED[type(req)])
    if req.stream_options is not None:
        update["stream_options"] = protocol.StreamOptions(
            include_usage=req.stream_options.include_usage)
    slim = req.model_copy(update=update)
    object.__setattr__(slim, "__pydantic_extra__", {})  # as pydantic's own __setstate__ does
    return slim


class BodyParser:
    """Parses bodies over `inline_bytes` in `num_children` child processes, one body each at a
    time; up to `max_waiting` more wait for one, beyond that ParserUnavailable. A child that dies
    or takes over `timeout_s` fails only its own body, and is replaced at its next use."""

    def __init__(self, limits: RequestLimits, num_children: int = 2, max_waiting: int = 16,
                 timeout_s: float = 30.0, inline_bytes: int = INLINE_PARSE_BYTES) -> None:
        self.limits = limits
        self.max_waiting, self.timeout_s, self.inline_bytes = max_waiting, timeout_s, inline_bytes
        self.children = [_Child() for _ in range(num_children)]
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        for child in self.children:
            self._idle.put_nowait(child)
        self._num_waiting = 0
        self._stopped = False

    async def start(self) -> None:
        """Starts the children now rather than at the first large body."""
        for child in self.children:
            await child.start()

    async def parse(self, kind: str, data: bytes, request_id: str) -> ParsedBody:
        """`parse` of the body: inline if small, else in a child; raises ParserUnavailable."""
        if len(data) <= self.inline_bytes:
            return parse(kind, data, request_id, self.limits)
        if self._stopped:
            raise ParserUnavailable("the server is stopping")
        if self._num_waiting >= self.max_waiting:
            raise ParserUnavailable(f"{self._num_waiting} large bodies are waiting to be parsed")
        self._num_waiting += 1
        try:
            child = await self._idle.get()
        finally:
            self._num_waiting -= 1
        try:
            job = pickle.dumps((kind, data, request_id, self.limits), pickle.HIGHEST_PROTOCOL)
            reply = await child.run(job, self.timeout_s)
        finally:
            self._idle.put_nowait(child)
        return await _decode(reply)

    async def stop(self) -> None:
        """Ends every child (a body in flight gets ParserUnavailable)."""
        self._stopped = True
        await asyncio.gather(*(child.end(grace_s=1.0) for child in self.children))


class _Child:
    """One child process, fed one job at a time over its stdin and answering on its stdout."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        if self.proc is not None:
            return
        root = os.path.dirname(os.path.dirname(os.path.abspath(scheduler_svc.__file__)))
        path = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        # Its own session: a Ctrl-C at the terminal is the server's to handle; the end of its
        # stdin (the server closing it, or exiting) ends the child.
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD_CODE, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 20, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})

    async def run(self, job: bytes, timeout_s: float) -> bytes:
        """The child's reply to `job`; raises ParserUnavailable (and ends the child) if it dies,
        hangs, or this call is cancelled midway."""
        try:
            await self.start()
        except OSError as err:
            log.warning("cannot start a body parser process: %s", err)
            raise ParserUnavailable("no process could be started to parse this body") from None
        done = False
        try:
            reply = await asyncio.wait_for(self._exchange(job), timeout_s)
            done = True
            return reply
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as err:
            hung = isinstance(err, asyncio.TimeoutError)
            # One whose pipes broke is ending: it is waited for, not killed, which would race
            # the watcher to reap it and lose its exit status.
            pid, code = await self.end(grace_s=0.0 if hung else 1.0)
            why = f"took over {timeout_s:g}s" if hung else f"ended ({_exit_text(code)})"
            if pid is not None:  # else `end` was called by the server's stop
                log.warning("the body parser process %d %s parsing a %d-byte job; another one "
                            "starts at the next large body", pid, why, len(job))
            raise ParserUnavailable(f"the process parsing this body {why}") from None
        finally:
            if not done:
                await self.end()

    async def _exchange(self, job: bytes) -> bytes:
        proc = self.proc  # `end` may clear self.proc meanwhile
        proc.stdin.write(_LENGTH.pack(len(job)))
        proc.stdin.write(job)
        await proc.stdin.drain()
        (size,) = _LENGTH.unpack(await proc.stdout.readexactly(_LENGTH.size))
        return await proc.stdout.readexactly(size)

    async def end(self, grace_s: float = 0.0) -> tuple[int | None, int | None]:
        """Ends the process (after `grace_s` to exit on its own); its pid and exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None, None
        if proc.returncode is None:
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                proc.kill()
        return proc.pid, await proc.wait()


def _exit_text(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


class _ChunkingPickler(pickle.Pickler):
    """Pickles long lists apart, in chunks of _CHUNK items, each cheap to unpickle; a list that
    several specs share (n over the engine's MAX_N) once."""

    def __init__(self, file) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.lists: list[list[bytes]] = []
        self._index: dict[int, int] = {}  # id(list) -> its place in self.lists

    def persistent_id(self, obj):
        if type(obj) is not list or len(obj) <= _CHUNK:
            return None
        if id(obj) not in self._index:
            self._index[id(obj)] = len(self.lists)
            self.lists.append([pickle.dumps(obj[i:i + _CHUNK], pickle.HIGHEST_PROTOCOL)
                               for i in range(0, len(obj), _CHUNK)])
        return self._index[id(obj)]


class _ListsUnpickler(pickle.Unpickler):
    def __init__(self, file, lists: list[list]) -> None:
        super().__init__(file)
        self.lists = lists

    def persistent_load(self, pid):
        return self.lists[pid]


def _encode(parsed: ParsedBody) -> bytes:
    head = io.BytesIO()
    pickler = _ChunkingPickler(head)
    pickler.dump(parsed)
    return pickle.dumps((head.getvalue(), pickler.lists), pickle.HIGHEST_PROTOCOL)


async def _decode(reply: bytes) -> ParsedBody:
    """The ParsedBody of a child's reply, its long lists rebuilt a chunk per loop turn: no single
    unpickling holds the GIL long, whatever the body held."""
    head, chunked = pickle.loads(reply)
    lists = []
    for chunks in chunked:
        items: list = []
        for chunk in chunks:
            items += pickle.loads(chunk)
            await asyncio.sleep(0)
        lists.append(items)
    return _ListsUnpickler(io.BytesIO(head), lists).load()


def child_main() -> None:
    """A child's loop: a job from stdin, its reply to stdout, until stdin ends."""
    # Below the serving processes: a burst of large bodies must not take their CPU.
    os.nice(10)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to the log, not into the replies
    source = sys.stdin.buffer
    try:
        while len(header := source.read(_LENGTH.size)) == _LENGTH.size:
            kind, data, request_id, limits = pickle.loads(source.read(_LENGTH.unpack(header)[0]))
            reply = _encode(parse(kind, data, request_id, limits))
            out.write(_LENGTH.pack(len(reply)))
            out.write(reply)
            out.flush()
    except (BrokenPipeError, pickle.UnpicklingError, EOFError):
        pass  # the server went away mid-job
