"""Entry point of the scheduler service (`pagedserve-scheduler`): flags and environment -> config,
then attach an executor and serve the public API. The only place the scheduler reads its environment.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import resource
import signal
import socket
import sys
import time
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn

from pagedserve_common.interrupt import interrupted_before_serving
from pagedserve_common.listener_flags import (LOG_LEVELS, check_ca_bundle, is_loopback, log_level,
                                              read_token)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.connection_gate import GateLimits
from scheduler_svc.engine_types import EngineConfig
from scheduler_svc.executor_client import LinkSecurity
from scheduler_svc.http_protocol import HttpLimits
from scheduler_svc.request import RequestLimits
from scheduler_svc.step_limits import StepLimitsGiven
from scheduler_svc.tool_parsers import TOOL_CALL_PARSERS

log = logging.getLogger("scheduler_svc")

# Net allocations of tracked objects between young collections once serving (default 700).
GC_YOUNG_THRESHOLD = 10_000


@dataclass(frozen=True)
class ServiceConfig:
    host: str
    port: int
    admin_host: str
    admin_port: int
    admin_token: str | None
    executor_addresses: tuple[str, ...]
    executor_file: str | None  # re-read on SIGHUP
    engine: EngineConfig
    step_timeout_s: float
    shutdown_timeout_s: float
    metrics_port: int
    http_port: int  # the OpenAI API; 0: off
    api_key: str | None
    served_model_names: tuple[str, ...]
    security: LinkSecurity
    executor_keepalive_s: float
    executor_connect_timeout_s: float
    executor_retry_interval_s: float
    log_level: str
    http_limits: HttpLimits
    grpc_limits: GateLimits  # of the public gRPC port
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


_PROG = "pagedserve-scheduler"
_ENV_PREFIX = "PAGEDSERVE_SCHEDULER_"
_STEPS_IN_FLIGHT = (1, 2, 3)  # plans out at once: lockstep, async scheduling, two steps ahead
_GENERATION_CONFIGS = ("auto", "vllm")
# Descriptors kept out of the connection caps: the Admin listener's connections, the executor
# links, the tokenizer, log and metrics files, gRPC's and asyncio's own.
_RESERVED_FILES = 128
_MAX_DERIVED_HTTP_CONNECTIONS = 16384
_RAISED_OPEN_FILES = 65536  # the soft limit is raised to the hard one, up to this


@dataclass(frozen=True)
class _Flag:
    """One flag: its built-in default, overridden by PAGEDSERVE_SCHEDULER_<FLAG>; `shown` is how
    --help words the default where the value alone would not say it."""

    name: str
    default: object
    help: str
    type: type = str  # bool: a switch; list: one or more values (comma separated in the variable)
    choices: tuple | None = None
    shown: str | None = None

    @property
    def env(self) -> str:
        return _ENV_PREFIX + self.name[2:].upper().replace("-", "_")


_FLAGS = (
    _Flag("--host", "127.0.0.1", "address of the public gRPC API and of the HTTP API"),
    _Flag("--port", 50051, "port of the public gRPC API (Generate, ModelInfo, health)", int),
    _Flag("--admin-host", "127.0.0.1", "address of the Admin API's own listener (anything but "
          "loopback needs --admin-token)"),
    _Flag("--admin-port", 50053, "port of the Admin API", int),
    _Flag("--admin-token", None, "bearer token Admin calls must present (authorization: Bearer "
          "...)", shown="none"),
    _Flag("--admin-token-file", None, "file holding the admin token (instead of --admin-token)",
          shown="none"),
    _Flag("--max-prompt-bytes", 1 << 20, "UTF-8 bytes of a text prompt, or of all chat "
          "messages, before tokenizing", int),
    _Flag("--max-chat-messages", 1024, "messages of a chat prompt", int),
    _Flag("--grammar-timeout", 5.0, "seconds a structured output's grammar (JSON schema, regex, "
          "choice, grammar) may take to compile at admission before the request is refused",
          float),
    _Flag("--executor", "127.0.0.1:50052", "executor address(es), comma separated, tried in "
          "order; or @FILE to read them from FILE, which SIGHUP re-reads to move serving to new "
          "executors"),
    _Flag("--max-num-batched-tokens", None, "token budget of a step (prefill chunks + decodes); "
          "never more than an executor on a GPU was sized for", int,
          shown="from the executor (vLLM's rule for its device), else 2048"),
    _Flag("--max-num-seqs", None, "sequences in a step; never more than an executor on a GPU "
          "was sized for", int, shown="from the executor (vLLM's rule for its device), else 256"),
    _Flag("--preemption-mode", "swap", "swap (while CPU swap pages are free, else recompute) or "
          "recompute", choices=("swap", "recompute")),
    _Flag("--no-prefix-caching", False, "turn off automatic prefix caching (on by default: a "
          "request reuses the cached KV pages of the longest prompt prefix already computed)",
          bool, shown="off (caching on)"),
    _Flag("--max-steps-in-flight", 2, "2: plan step N+1 while the executor runs step N (async "
          "scheduling); 3: plan two steps ahead (the executor holds the third plan until a step "
          "ends); 1: lockstep", int, _STEPS_IN_FLIGHT),
    _Flag("--max-waiting", 4096, "sequences waiting to start, a request counting its n samples, "
          "as --max-num-seqs counts running ones (beyond it: RESOURCE_EXHAUSTED, HTTP 429)", int),
    _Flag("--step-timeout", 60.0, "seconds without a step result before the executor counts as "
          "hung", float),
    _Flag("--unavailable-grace", 30.0, "seconds without any executor before Generate answers "
          "UNAVAILABLE", float),
    _Flag("--shutdown-timeout", 30.0, "seconds SIGTERM waits for running requests", float),
    _Flag("--metrics-port", 0, "port of the Prometheus /metrics endpoint (0: off)", int),
    _Flag("--http-port", 8000, "port of the OpenAI-compatible HTTP API, on --host (0: off)", int),
    _Flag("--http-max-connections", 0, "HTTP connections open at once; at the cap a newcomer "
          "takes the place of the least recently active idle connection of the peer holding the "
          "most, else of the least recently active connection, busy too, of a peer holding 2 "
          "more than the newcomer's, else is answered 429 with Retry-After (0: derived from the "
          "open-file limit, ulimit -n, raised to its hard limit: half of what the reserved "
          f"descriptors leave, at most {_MAX_DERIVED_HTTP_CONNECTIONS})", int),
    _Flag("--grpc-max-connections", 0, "connections to the public gRPC port open at once; at "
          "the cap a newcomer takes the place of a connection as over HTTP (a busy one's calls "
          "end UNAVAILABLE), else is closed (0: derived from the open-file limit: a quarter of "
          "what the reserved descriptors leave, three a connection)", int),
    _Flag("--http-header-timeout", 10.0, "seconds a client has to send a request's line and "
          "headers, from its first byte (or from the connection's opening): 408 after", float),
    _Flag("--http-body-timeout", 30.0, "seconds a client has to send a request's body, from the "
          "end of its headers: 408 after", float),
    _Flag("--http-keep-alive-timeout", 5.0, "seconds an idle HTTP connection is kept open "
          "between requests (vLLM's)", float),
    _Flag("--api-key", None, "key the HTTP API's /v1 routes require (authorization: Bearer ...)",
          shown="none"),
    _Flag("--api-key-file", None, "file holding the API key (instead of --api-key)",
          shown="none"),
    _Flag("--enable-auto-tool-choice", False, "serve tool_choice \"auto\" (a chat request's "
          "default when it gives tools): the model chooses whether to call, --tool-call-parser "
          "finds its calls (vLLM's flag; without it such requests are refused, \"required\" "
          "and named choices are served either way)", bool, shown="off"),
    _Flag("--tool-call-parser", None, "the model family's tool call format, for tool_choice "
          "\"auto\": hermes (Hermes, Qwen 2.5 and 3, SmolLM2) or llama3_json (Llama 3.x)",
          choices=TOOL_CALL_PARSERS, shown="none"),
    _Flag("--served-model-name", [], "model name(s) the HTTP API answers to, the first reported",
          list, shown="the executor's model name, from its model path"),
    _Flag("--executor-tls-ca", None, "PEM CA bundle: talk TLS to the executor and verify it",
          shown="none: plaintext"),
    _Flag("--executor-tls-server-name", None, "name to check in the executor's certificate",
          shown="its host"),
    _Flag("--executor-token", None, "shared token presented to the executor", shown="none"),
    _Flag("--executor-token-file", None, "file holding the executor token (instead of "
          "--executor-token)", shown="none"),
    _Flag("--executor-takeover", False, "take the executor's lease even from another live "
          "scheduler (honoured only by an executor that requires a token)", bool, shown="off"),
    _Flag("--executor-keepalive", 10.0, "seconds between keepalive pings on the executor link "
          "(>= 1)", float),
    _Flag("--executor-connect-timeout", 5.0, "seconds an executor has to answer Describe, then "
          "the lease hello, before the next address is tried", float),
    _Flag("--executor-retry-interval", 2.0, "longest wait between two rounds over the executor "
          "addresses while none answers (the waits start at 0.05s and double; at most 0.25s "
          "until the first attach): how soon an executor that came back is attached", float),
    _Flag("--log-level", "INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL, any case; DEBUG adds "
          "a line per request admitted, finished or cancelled", log_level, LOG_LEVELS),
    _Flag("--log-stats-interval", 10.0, "seconds between stats lines (sequences, KV pages, "
          "tokens/s), logged only for an interval in which a step ran, and between lines saying "
          "what the scheduler waits for while no executor is attached (0: off)", float),
    _Flag("--stream-interval", 0, "hand each stream its tokens every N steps (its first token "
          "and its end at once); 0: adaptive, every step while a step samples up to 256 "
          "sequences, then every ceil(sampled / 256) steps (vLLM's --stream-interval, made "
          "adaptive)", int),
    _Flag("--generation-config", "auto", "auto: a request's unset temperature, top_p, top_k, "
          "min_p, repetition_penalty and max_tokens take the model's generation_config.json "
          "values (as vLLM's --generation-config); vllm: the APIs' own defaults", str,
          choices=_GENERATION_CONFIGS),
)


def _env_default(flag: _Flag):
    """The flag's default from its environment variable, else the built-in one; a bad value ends
    the program with one line naming the variable and its flag (argparse would only name the
    flag)."""
    raw = os.environ.get(flag.env)
    if raw is None:
        return flag.default
    if flag.type is bool:
        return raw not in ("", "0", "false")
    if flag.type is list:
        return raw.split(",")
    try:
        return flag.type(raw)
    except ValueError:
        _fail(f"{flag.env}={raw!r} is not a valid {flag.type.__name__} (it sets {flag.name}): "
              f"fix or unset it")


def _fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, argparse style, then exit."""
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    """Every flag, its help ending with its default and its environment variable."""
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__)
    for flag in _FLAGS:
        shown = flag.shown if flag.shown is not None else f"{flag.default:g}" if isinstance(
            flag.default, float) else str(flag.default)
        kwargs = dict(default=_env_default(flag),
                      help=f"{flag.help} (default: {shown}; env {flag.env})".replace("%", "%%"))
        if flag.type is bool:
            kwargs["action"] = "store_true"
        elif flag.type is list:
            kwargs["nargs"] = "+"
        else:
            kwargs.update(type=flag.type, choices=flag.choices)
        p.add_argument(flag.name, **kwargs)
    return p


def connection_caps(open_files: int) -> tuple[int, int, int]:
    """(HTTP cap, gRPC cap, accept batch) the open-file limit leaves room for: of what the
    reserved descriptors and both listeners' passing ones (accepted, not yet counted; closed, not
    yet gone) leave, a half for HTTP (the 429 answers' linger above it) and a quarter for gRPC
    (three descriptors a connection behind the gate)."""
    batch = min(max(open_files // 64, 16), 256)
    passing = (HttpLimits(max_connections=0, accept_batch=batch).max_descriptors()
               + GateLimits(max_connections=0, accept_batch=batch).max_descriptors())
    spare = max(open_files - _RESERVED_FILES - passing, 12)
    return min(spare // 2, _MAX_DERIVED_HTTP_CONNECTIONS), spare // 12, batch


def _open_file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_file_limit() -> None:
    """The soft open-file limit up to the hard one (as Go's runtime does): a soft limit of 1,024,
    common, would cap the HTTP API at a few hundred connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _RAISED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _RAISED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def parse_config(argv: list[str] | None = None) -> ServiceConfig:
    p = build_parser()
    a = p.parse_args(argv)
    _check_values(p, a)
    admin_token = read_token(p, a.admin_token, a.admin_token_file, "--admin-token")
    if admin_token is None and not is_loopback(a.admin_host):
        p.error(f"--admin-host {a.admin_host} is not a loopback address: set --admin-token "
                "(or --admin-token-file) so that only operators can call Admin")
    check_ca_bundle(p, "--executor-tls-ca", a.executor_tls_ca)
    executor_token = read_token(p, a.executor_token, a.executor_token_file, "--executor-token")
    api_key = read_token(p, a.api_key, a.api_key_file, "--api-key")
    scheduler, given = _step_limits(a)
    scheduler = replace(scheduler, preemption_mode=a.preemption_mode,
                        enable_prefix_caching=not a.no_prefix_caching)
    http_limits, grpc_limits = _connection_limits(p, a)
    return ServiceConfig(
        host=a.host, port=a.port, admin_host=a.admin_host, admin_port=a.admin_port,
        admin_token=admin_token,
        executor_addresses=_executor_addresses(a.executor),
        executor_file=a.executor[1:] if a.executor.startswith("@") else None,
        engine=EngineConfig(scheduler=scheduler, max_waiting=a.max_waiting,
                            max_steps_in_flight=a.max_steps_in_flight,
                            unavailable_grace_s=a.unavailable_grace,
                            log_stats_interval_s=a.log_stats_interval,
                            stream_interval=a.stream_interval,
                            generation_config=a.generation_config, step_limits_given=given,
                            limits=RequestLimits(max_prompt_bytes=a.max_prompt_bytes,
                                                 max_chat_messages=a.max_chat_messages,
                                                 grammar_timeout_s=a.grammar_timeout)),
        step_timeout_s=a.step_timeout, shutdown_timeout_s=a.shutdown_timeout,
        metrics_port=a.metrics_port, http_port=a.http_port, api_key=api_key,
        served_model_names=tuple(n.strip() for n in a.served_model_name if n.strip()),
        security=LinkSecurity(tls_ca=a.executor_tls_ca, tls_server_name=a.executor_tls_server_name,
                              auth_token=executor_token, takeover=a.executor_takeover),
        executor_keepalive_s=a.executor_keepalive,
        executor_connect_timeout_s=a.executor_connect_timeout,
        executor_retry_interval_s=a.executor_retry_interval,
        log_level=a.log_level, http_limits=http_limits, grpc_limits=grpc_limits,
        tool_call_parser=a.tool_call_parser, enable_auto_tool_choice=a.enable_auto_tool_choice)


def _check_values(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for flag in _FLAGS:  # argparse checks the command line's choices, not an environment default
        value = getattr(a, flag.name[2:].replace("-", "_"))
        if flag.choices and value is not None and value not in flag.choices:
            p.error(f"{flag.name} must be one of {', '.join(map(str, flag.choices))} (from "
                    f"{flag.env}), got {value!r}")
    for flag in ("--port", "--admin-port", "--http-port", "--metrics-port"):
        value = getattr(a, flag[2:].replace("-", "_"))
        if not 0 <= value <= 65535:  # gRPC would take 99999 as 34463
            p.error(f"{flag} must be a port number, 0 to 65535, got {value}")
    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--max-waiting",
                 "--max-prompt-bytes", "--max-chat-messages"):
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    for flag in ("--shutdown-timeout", "--unavailable-grace", "--log-stats-interval"):
        value = getattr(a, flag[2:].replace("-", "_"))
        if not value >= 0:  # nan fails too
            p.error(f"{flag} must be >= 0 seconds, got {value}")
    if a.stream_interval < 0:
        p.error(f"--stream-interval must be >= 0, got {a.stream_interval}")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser (the model's tool call "
                f"format: {', '.join(TOOL_CALL_PARSERS)})")
    if not a.executor_keepalive >= 1:
        p.error(f"--executor-keepalive must be >= 1 second, got {a.executor_keepalive}")
    for flag in ("--executor-connect-timeout", "--executor-retry-interval", "--grammar-timeout",
                 "--step-timeout", "--http-header-timeout", "--http-body-timeout",
                 "--http-keep-alive-timeout"):
        value = getattr(a, flag[2:].replace("-", "_"))
        if not value > 0:
            p.error(f"{flag} must be > 0 seconds, got {value}")
    for flag in ("--http-max-connections", "--grpc-max-connections"):
        if getattr(a, flag[2:].replace("-", "_")) < 0:
            p.error(f"{flag} must be >= 0 (0: derived from the open-file limit)")


def _step_limits(a: argparse.Namespace) -> tuple[SchedulerConfig, StepLimitsGiven]:
    """The step-limit flags given (the others: the built-in defaults, used until an executor
    recommends its own), and which were given."""
    given = StepLimitsGiven(max_num_batched_tokens=a.max_num_batched_tokens is not None,
                            max_num_seqs=a.max_num_seqs is not None)
    values = {name: getattr(a, name) for name in ("max_num_batched_tokens", "max_num_seqs")
              if getattr(a, name) is not None}
    return SchedulerConfig(**values), given


def _connection_limits(p: argparse.ArgumentParser, a: argparse.Namespace
                       ) -> tuple[HttpLimits, GateLimits]:
    """The HTTP and the public gRPC port's limits; caps the open-file limit cannot hold are an
    error here rather than accept failures under load."""
    open_files = _open_file_limit()
    http_cap, grpc_cap, batch = connection_caps(open_files)
    limits = HttpLimits(max_connections=a.http_max_connections or http_cap,
                        header_timeout_s=a.http_header_timeout,
                        body_timeout_s=a.http_body_timeout,
                        keep_alive_timeout_s=a.http_keep_alive_timeout, accept_batch=batch)
    grpc = GateLimits(max_connections=a.grpc_max_connections or grpc_cap, accept_batch=batch)
    needed = limits.max_descriptors() + grpc.max_descriptors() + _RESERVED_FILES
    if (a.http_max_connections or a.grpc_max_connections) and needed > open_files:
        p.error(f"--http-max-connections {limits.max_connections} and --grpc-max-connections "
                f"{grpc.max_connections} need an open-file limit of at least {needed} (ulimit "
                f"-n is {open_files}): raise it, or lower them")
    return limits, grpc


def _executor_addresses(spec: str) -> tuple[str, ...]:
    try:
        addresses = read_addresses(spec)
    except OSError as err:
        _fail(f"--executor {spec}: {err.strerror or err}: give host:port[,host:port...] or @FILE")
    if not addresses:
        _fail(f"--executor {spec!r} names no address: give host:port[,host:port...] or @FILE")
    return addresses


def read_addresses(spec: str) -> tuple[str, ...]:
    """'host:port,host:port' or '@FILE' (addresses separated by commas or lines)."""
    if spec.startswith("@"):
        with open(spec[1:]) as f:
            spec = f.read().replace("\n", ",")
    return tuple(x.strip() for x in spec.split(",") if x.strip())


async def _reload_executors(path: str, engine) -> None:
    """SIGHUP: move serving to the addresses now in `path`, as the Admin call would."""
    try:
        addresses = read_addresses("@" + path)
        address, _, moved = await engine.switch_executor(list(addresses))
        log.info("SIGHUP: now serving from %s (%d sequences moved)", address, moved)
    except Exception as err:  # noqa: BLE001 - a bad reload must not stop the service
        log.error("SIGHUP: executors in %s not taken: %s", path, err)


def executor_client(config: ServiceConfig):
    """The link to the executors, with every timing the flags set."""
    from scheduler_svc.executor_client import ExecutorClient

    return ExecutorClient(list(config.executor_addresses), step_timeout_s=config.step_timeout_s,
                          describe_timeout_s=config.executor_connect_timeout_s,
                          max_backoff_s=config.executor_retry_interval_s,
                          security=config.security, keepalive_s=config.executor_keepalive_s)


def _warm_tokenizer_imports() -> None:
    """While the first executor loads: the imports its tokenizer will need (loading one reports
    its own errors, so a failure here is only logged)."""
    from scheduler_svc.tokenizer import warm_imports

    try:
        warm_imports()
    except Exception as err:  # noqa: BLE001 - the attach's own load says what is wrong
        log.debug("warming the tokenizer imports failed: %r", err)


async def serve(config: ServiceConfig) -> None:
    from scheduler_svc.engine import Engine
    from scheduler_svc.metrics import Metrics
    from scheduler_svc.openai_server import OpenAIConfig, OpenAIServer
    from scheduler_svc.vllm_metrics import VllmCollector

    client = executor_client(config)
    metrics = Metrics()
    engine = Engine(config.engine, client, metrics)
    max_message_bytes = config.engine.limits.max_prompt_bytes + 2 * 1024 * 1024
    http = OpenAIServer(engine, OpenAIConfig(config.api_key, config.served_model_names,
                                             max_message_bytes, config.http_limits,
                                             config.tool_call_parser,
                                             config.enable_auto_tool_choice),
                        metrics.registry)
    metrics.registry.register(VllmCollector(metrics, http.model_name))
    public, admin, health, (port, admin_port, http_port) = await _listen(
        config, engine, metrics, http, max_message_bytes)
    reporter = _HealthReporter(health)
    reporter.set(False)
    engine.on_attached_change = _frozen_before_first_serving(reporter.set)
    log.info("scheduler listening on %s:%d (admin on %s:%d%s%s); waiting for an executor at %s",
             config.host, port, config.admin_host, admin_port,
             ", token required" if config.admin_token else "",
             f"; OpenAI API on http://{config.host}:{http_port}/v1"
             f"{', API key required' if config.api_key else ''}" if http_port else "",
             ", ".join(config.executor_addresses))
    log.info("connections open at once: HTTP %d, gRPC %d (open-file limit %d); then idle ones, "
             "else those of a peer over its share, make room, else 429 / closed",
             config.http_limits.max_connections, config.grpc_limits.max_connections,
             _open_file_limit())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.executor_file:
        reloads: set[asyncio.Task] = set()

        def on_hup() -> None:
            task = asyncio.ensure_future(_reload_executors(config.executor_file, engine))
            reloads.add(task)
            task.add_done_callback(reloads.discard)
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    threading.Thread(target=_warm_tokenizer_imports, name="warm-imports", daemon=True).start()
    await engine.start()
    detached = (asyncio.create_task(_log_while_detached(engine, config.engine.log_stats_interval_s))
                if config.engine.log_stats_interval_s > 0 else None)
    ready = asyncio.create_task(engine.wait_ready())
    await asyncio.wait({ready, asyncio.create_task(stop.wait())},
                       return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        log.info("scheduler ready: serving %s", client.description.model_name)
        await stop.wait()
    if detached is not None:
        detached.cancel()
    await _shutdown(config, engine, (public, admin), http, reporter)


class StartError(Exception):
    """The service cannot start (a port in use): one line, naming the flag."""


async def _listen(config: ServiceConfig, engine, metrics, http, max_message_bytes: int):
    """Binds and starts every listener: (public, admin, health, (port, admin port, HTTP port)).
    Every port is tried before any listener starts; if one still fails, those started are
    stopped before StartError is raised, so nothing outlives the event loop."""
    from scheduler_svc.server import Listeners, ListenError, build_servers

    ports = (("--port", config.host, config.port),
             ("--admin-port", config.admin_host, config.admin_port),
             ("--http-port", config.host, config.http_port),
             ("--metrics-port", config.host, config.metrics_port))
    taken: dict[tuple[str, int], str] = {}
    for flag, host, port in ports:
        if port and (host, port) in taken:
            raise StartError(f"{flag} {port}: {taken[host, port]} listens there already")
        taken[host, port] = flag
        _check_free(flag, host, port)
    failure, servers, flag = None, (), ""
    try:
        if config.metrics_port:
            flag = f"--metrics-port {config.metrics_port}: "
            metrics.serve(config.metrics_port, config.host)
        flag = ""
        public, admin, health, port, admin_port = build_servers(engine, Listeners(
            public=f"{config.host}:{config.port}", admin=f"{config.admin_host}:{config.admin_port}",
            admin_token=config.admin_token, limits=config.engine.limits,
            max_message_bytes=max_message_bytes, gate=config.grpc_limits))
        servers = (public, admin)
        await public.start()
        await admin.start()
        flag = f"--http-port {config.http_port}: "
        http_port = await http.start(config.host, config.http_port) if config.http_port else 0
    except RuntimeError as err:  # ListenError among them
        if isinstance(err, ListenError):
            flag = (f"--port {config.port}: " if err.listener == "public"
                    else f"--admin-port {config.admin_port}: ")
        failure = f"{flag}{err}"
    if failure is None:
        return public, admin, health, (port, admin_port, http_port)
    # the error (and the frames it holds, servers among them) is gone: stop what started
    await asyncio.gather(*(server.stop(None) for server in servers))
    raise StartError(failure)


def _check_free(flag: str, host: str, port: int) -> None:
    """StartError naming `flag` if host:port cannot be bound (grpc would log its own lines)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host.strip("[]"), port), family=family).close()
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise StartError(f"{flag} {port}: cannot listen on {host}:{port} (in use, or not an "
                         f"address here): {reason}") from None


async def _log_while_detached(engine, interval_s: float) -> None:
    """Every `interval_s` without an executor attached (the first one may take minutes to load
    its model; a lost one may never come back), a line saying what the scheduler waits for and
    for how long, counted from when the link went down, not from the last tick. Silent while the
    link is up: the client logs `attached executor` as its stream opens, before the engine has
    loaded the tokenizer and counts as attached."""
    while True:
        await asyncio.sleep(interval_s)
        since = engine.client.disconnected_since
        if since is None or engine.status().attached:
            continue
        waited = time.monotonic() - since
        if waited >= interval_s:
            log.info("still no executor attached after %.3gs: %s", waited,
                     engine.status().attach_error or "waiting for one")


async def _shutdown(config: ServiceConfig, engine, servers, http, reporter) -> None:
    """Stops admission, lets running requests finish up to --shutdown-timeout, then ends the rest
    with finish reason ABORTED."""
    log.info("shutting down: draining %d requests for up to %.0fs", engine.num_requests,
             config.shutdown_timeout_s)
    reporter.set(False)
    engine.start_draining()
    try:
        await asyncio.wait_for(engine.wait_idle(), config.shutdown_timeout_s)
    except asyncio.TimeoutError:
        log.warning("ending %d requests still running", engine.num_requests)
        engine.abort_all()
    await asyncio.gather(http.stop(), *(server.stop(grace=5) for server in servers))
    await engine.stop()


def freeze_startup_heap() -> int:
    """Moves every object alive now (modules, the tokenizer, the engine) out of the garbage
    collector's reach, as vLLM does once it is ready, so that its scans see only what serving
    allocates; a step's events die young, hence the higher young threshold. For a service
    process once ready, not for tests, which would keep every engine they make. Returns the
    objects frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    return gc.get_freeze_count()


def _frozen_before_first_serving(report: Callable[[bool], None]) -> Callable[[bool], None]:
    """`report` (attached: health goes SERVING, or NOT_SERVING), the first SERVING preceded by
    freeze_startup_heap: its full collection then happens before any client is told to send,
    not while the first requests wait."""
    frozen = False

    def on_attached_change(attached: bool) -> None:
        nonlocal frozen
        if attached and not frozen:
            frozen = True
            log.debug("%d objects frozen out of the garbage collector's scans",
                      freeze_startup_heap())
        report(attached)
    return on_attached_change


class _HealthReporter:
    """Mirrors 'an executor is attached' into grpc.health.v1 for the scheduler's services."""

    def __init__(self, health) -> None:
        from scheduler_svc.server import ADMIN_SERVICE_NAME, SERVICE_NAME

        self._health = health
        self._names = ("", SERVICE_NAME, ADMIN_SERVICE_NAME)
        self._tasks: set[asyncio.Task] = set()

    def set(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._names:
            task = asyncio.ensure_future(self._health.set(name, status))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


def main(argv: list[str] | None = None) -> None:
    raise_open_file_limit()
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with interrupted_before_serving(_PROG):  # until serve() installs its stop handler
            asyncio.run(serve(config))
    except StartError as err:
        _fail(str(err), code=1)
    except Exception as err:  # noqa: BLE001 - a start failure: one line, traceback on debug
        if str(config.log_level).upper() == "DEBUG":
            traceback.print_exception(err)
        first_line = (str(err).strip().splitlines() or [""])[0]
        _fail(f"{type(err).__name__}: {first_line} (--log-level debug shows the traceback)", 1)


if __name__ == "__main__":
    main()
