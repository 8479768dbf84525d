"""Entry point of the scheduler service (`pagedserve-scheduler`): flags and environment -> config,
then attach an executor and serve the public API. The only place the scheduler reads its environment.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineConfig, freeze_startup_heap
from scheduler_svc.executor_client import LinkSecurity
from scheduler_svc.request import RequestLimits

log = logging.getLogger("scheduler_svc")


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


_PROG = "pagedserve-scheduler"
_ENV_PREFIX = "PAGEDSERVE_SCHEDULER_"
_STEPS_IN_FLIGHT = (1, 2, 3)  # plans out at once: lockstep, async scheduling, two steps ahead


def _env(name: str, default):
    return os.environ.get(f"{_ENV_PREFIX}{name}", default)


def _env_number(name: str, convert, default):
    """The environment value of a numeric flag, converted; a bad one ends the program with one
    line naming the variable and its flag (argparse would only name the flag)."""
    raw = os.environ.get(f"{_ENV_PREFIX}{name}")
    if raw is None:
        return default
    try:
        return convert(raw)
    except ValueError:
        flag = "--" + name.lower().replace("_", "-")
        _fail(f"{_ENV_PREFIX}{name}={raw!r} is not a valid {convert.__name__} (it sets {flag}): "
              f"fix or unset it")


def _fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, argparse style, then exit."""
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    sys.exit(code)


def parse_config(argv: list[str] | None = None) -> ServiceConfig:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env_number("PORT", int, 50051))
    p.add_argument("--admin-host", default=_env("ADMIN_HOST", "127.0.0.1"),
                   help="address of the Admin API's own listener (anything but loopback needs "
                        "--admin-token)")
    p.add_argument("--admin-port", type=int, default=_env_number("ADMIN_PORT", int, 50053))
    p.add_argument("--admin-token", default=_env("ADMIN_TOKEN", None),
                   help="bearer token Admin calls must present (authorization: Bearer ...)")
    p.add_argument("--admin-token-file", default=_env("ADMIN_TOKEN_FILE", None),
                   help="file holding the admin token (instead of --admin-token)")
    p.add_argument("--max-prompt-bytes", type=int,
                   default=_env_number("MAX_PROMPT_BYTES", int, 1 << 20),
                   help="UTF-8 bytes of a text prompt, or of all chat messages, before tokenizing")
    p.add_argument("--max-chat-messages", type=int,
                   default=_env_number("MAX_CHAT_MESSAGES", int, 1024))
    p.add_argument("--executor", default=_env("EXECUTOR", "127.0.0.1:50052"),
                   help="executor address(es), comma separated, tried in order; or @FILE to read "
                        "them from FILE, which SIGHUP re-reads to move serving to new executors")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_env_number("MAX_NUM_BATCHED_TOKENS", int, 2048))
    p.add_argument("--max-num-seqs", type=int, default=_env_number("MAX_NUM_SEQS", int, 256))
    p.add_argument("--preemption-mode", default=_env("PREEMPTION_MODE", "swap"),
                   choices=["swap", "recompute"])
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=_env("NO_PREFIX_CACHING", "") not in ("", "0", "false"),
                   help="turn off automatic prefix caching (on by default: a request reuses "
                        "the cached KV pages of the longest prompt prefix already computed)")
    p.add_argument("--max-steps-in-flight", type=int,
                   default=_env_number("MAX_STEPS_IN_FLIGHT", int, 2), choices=_STEPS_IN_FLIGHT,
                   help="2: plan step N+1 while the executor runs step N (async scheduling); "
                        "3: plan two steps ahead (the executor holds the third plan until a "
                        "step ends); 1: lockstep")
    p.add_argument("--max-waiting", type=int, default=_env_number("MAX_WAITING", int, 4096))
    p.add_argument("--step-timeout", type=float, default=_env_number("STEP_TIMEOUT", float, 60.0),
                   help="seconds without a step result before the executor counts as hung")
    p.add_argument("--unavailable-grace", type=float,
                   default=_env_number("UNAVAILABLE_GRACE", float, 30.0),
                   help="seconds without any executor before Generate answers UNAVAILABLE")
    p.add_argument("--shutdown-timeout", type=float,
                   default=_env_number("SHUTDOWN_TIMEOUT", float, 30.0))
    p.add_argument("--metrics-port", type=int, default=_env_number("METRICS_PORT", int, 0),
                   help="port of the Prometheus /metrics endpoint (0: off)")
    p.add_argument("--http-port", type=int, default=_env_number("HTTP_PORT", int, 8000),
                   help="port of the OpenAI-compatible HTTP API, on --host (0: off)")
    p.add_argument("--api-key", default=_env("API_KEY", None),
                   help="key the HTTP API's /v1 routes require (authorization: Bearer ...)")
    p.add_argument("--api-key-file", default=_env("API_KEY_FILE", None),
                   help="file holding the API key (instead of --api-key)")
    p.add_argument("--served-model-name", nargs="+",
                   default=_env("SERVED_MODEL_NAME", "").split(","),  # comma separated there
                   help="model name(s) the HTTP API answers to, the first reported (default: "
                        "the executor's model name, from its model path)")
    p.add_argument("--executor-tls-ca", default=_env("EXECUTOR_TLS_CA", None),
                   help="PEM CA bundle: talk TLS to the executor and verify it")
    p.add_argument("--executor-tls-server-name", default=_env("EXECUTOR_TLS_SERVER_NAME", None),
                   help="name to check in the executor's certificate (default: its host)")
    p.add_argument("--executor-token", default=_env("EXECUTOR_TOKEN", None),
                   help="shared token presented to the executor")
    p.add_argument("--executor-token-file", default=_env("EXECUTOR_TOKEN_FILE", None),
                   help="file holding the executor token (instead of --executor-token)")
    p.add_argument("--executor-takeover", action="store_true",
                   default=_env("EXECUTOR_TAKEOVER", "") not in ("", "0", "false"),
                   help="take the executor's lease even from another live scheduler (honoured "
                        "only by an executor that requires a token)")
    p.add_argument("--executor-keepalive", type=float,
                   default=_env_number("EXECUTOR_KEEPALIVE", float, 10.0),
                   help="seconds between keepalive pings on the executor link (>= 1)")
    p.add_argument("--executor-connect-timeout", type=float,
                   default=_env_number("EXECUTOR_CONNECT_TIMEOUT", float, 5.0),
                   help="seconds an executor has to answer Describe, then the lease hello, before "
                        "the next address is tried")
    p.add_argument("--executor-retry-interval", type=float,
                   default=_env_number("EXECUTOR_RETRY_INTERVAL", float, 2.0),
                   help="longest wait between two rounds over the executor addresses while none "
                        "answers (the waits start at 0.05s and double): how soon an executor "
                        "that finished loading, or came back, is attached")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   help="DEBUG adds a line per request admitted, finished or cancelled")
    p.add_argument("--log-stats-interval", type=float,
                   default=_env_number("LOG_STATS_INTERVAL", float, 10.0),
                   help="seconds between stats lines (sequences, KV pages, tokens/s), logged "
                        "only for an interval in which a step ran, and between lines saying "
                        "what the scheduler waits for while no executor is attached (0: off)")
    p.add_argument("--stream-interval", type=int, default=_env_number("STREAM_INTERVAL", int, 0),
                   help="hand each stream its tokens every N steps (its first token and its end "
                        "at once); 0: adaptive, every step while a step samples up to 256 "
                        "sequences, then every ceil(sampled / 256) steps (vLLM's "
                        "--stream-interval, made adaptive)")
    a = p.parse_args(argv)
    if a.max_steps_in_flight not in _STEPS_IN_FLIGHT:  # argparse checks no environment default
        p.error(f"--max-steps-in-flight must be one of {_STEPS_IN_FLIGHT} (from "
                f"{_ENV_PREFIX}MAX_STEPS_IN_FLIGHT), got {a.max_steps_in_flight}")
    if a.stream_interval < 0:
        p.error(f"--stream-interval must be >= 0, got {a.stream_interval}")
    if not a.executor_keepalive >= 1:
        p.error(f"--executor-keepalive must be >= 1 second, got {a.executor_keepalive}")
    for flag, value in (("--executor-connect-timeout", a.executor_connect_timeout),
                        ("--executor-retry-interval", a.executor_retry_interval)):
        if not value > 0:
            p.error(f"{flag} must be > 0 seconds, got {value}")
    admin_token = _token(p, a.admin_token, a.admin_token_file, "--admin-token")
    if admin_token is None and not _is_loopback(a.admin_host):
        p.error(f"--admin-host {a.admin_host} is not a loopback address: set --admin-token "
                "(or --admin-token-file) so that only operators can call Admin")
    executor_token = _token(p, a.executor_token, a.executor_token_file, "--executor-token")
    api_key = _token(p, a.api_key, a.api_key_file, "--api-key")
    scheduler = SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                max_num_seqs=a.max_num_seqs, preemption_mode=a.preemption_mode,
                                enable_prefix_caching=not a.no_prefix_caching)
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
                            limits=RequestLimits(max_prompt_bytes=a.max_prompt_bytes,
                                                 max_chat_messages=a.max_chat_messages)),
        step_timeout_s=a.step_timeout, shutdown_timeout_s=a.shutdown_timeout,
        metrics_port=a.metrics_port, http_port=a.http_port, api_key=api_key,
        served_model_names=tuple(n.strip() for n in a.served_model_name if n.strip()),
        security=LinkSecurity(tls_ca=a.executor_tls_ca, tls_server_name=a.executor_tls_server_name,
                              auth_token=executor_token, takeover=a.executor_takeover),
        executor_keepalive_s=a.executor_keepalive,
        executor_connect_timeout_s=a.executor_connect_timeout,
        executor_retry_interval_s=a.executor_retry_interval,
        log_level=a.log_level)


def _token(parser, value: str | None, path: str | None, flag: str) -> str | None:
    """A token given on the command line or in a file (stripped); both or an empty one is an error."""
    if value and path:
        parser.error(f"give {flag} or {flag}-file, not both")
    if path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as err:
            parser.error(f"{flag}-file: {err}")
        if not value:
            parser.error(f"{flag}-file {path} is empty")
    return value or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _executor_addresses(spec: str) -> tuple[str, ...]:
    try:
        return read_addresses(spec)
    except OSError as err:
        _fail(f"--executor {spec}: {err.strerror or err}: give host:port[,host:port...] or @FILE")


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


async def serve(config: ServiceConfig) -> None:
    from scheduler_svc.engine import Engine
    from scheduler_svc.metrics import Metrics
    from scheduler_svc.openai_server import OpenAIConfig, OpenAIServer
    from scheduler_svc.server import Listeners, build_servers
    from scheduler_svc.vllm_metrics import VllmCollector

    client = executor_client(config)
    metrics = Metrics()
    engine = Engine(config.engine, client, metrics)
    limits = config.engine.limits
    max_message_bytes = limits.max_prompt_bytes + 2 * 1024 * 1024
    http = OpenAIServer(engine, OpenAIConfig(config.api_key, config.served_model_names,
                                             max_message_bytes), metrics.registry)
    metrics.registry.register(VllmCollector(metrics, http.model_name))
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    public, admin, health, port, admin_port = build_servers(engine, Listeners(
        public=f"{config.host}:{config.port}", admin=f"{config.admin_host}:{config.admin_port}",
        admin_token=config.admin_token, limits=limits, max_message_bytes=max_message_bytes))
    reporter = _HealthReporter(health)
    reporter.set(False)
    engine.on_attached_change = _frozen_before_first_serving(reporter.set)
    await public.start()
    await admin.start()
    http_port = await http.start(config.host, config.http_port) if config.http_port else 0
    log.info("scheduler listening on %s:%d (admin on %s:%d%s%s); waiting for an executor at %s",
             config.host, port, config.admin_host, admin_port,
             ", token required" if config.admin_token else "",
             f"; OpenAI API on http://{config.host}:{http_port}/v1"
             f"{', API key required' if config.api_key else ''}" if http_port else "",
             ", ".join(config.executor_addresses))
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


async def _log_while_detached(engine, interval_s: float) -> None:
    """Every `interval_s` without an executor attached (the first one may take minutes to load
    its model; a lost one may never come back), a line saying what the scheduler waits for."""
    num_intervals = 0
    while True:
        await asyncio.sleep(interval_s)
        status = engine.status()
        num_intervals = 0 if status.attached else num_intervals + 1
        if num_intervals:
            log.info("still no executor attached after %gs: %s", num_intervals * interval_s,
                     status.attach_error or "waiting for one")


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


def _frozen_before_first_serving(report: Callable[[bool], None]) -> Callable[[bool], None]:
    """`report` (attached: health goes SERVING, or NOT_SERVING), the first SERVING preceded by
    freeze_startup_heap: its full collection then happens before any client is told to send,
    not while the first requests wait (sent on SERVING, W1's first request reached the scheduler
    125 ms after its submission on the H200 host; a 64-request burst's, 46-63 ms on a 2-core VM,
    4-8 ms once the collection came first)."""
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
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except Exception as err:  # noqa: BLE001 - a start failure: one line, traceback on debug
        if str(config.log_level).upper() == "DEBUG":
            traceback.print_exception(err)
        if "cannot listen" in str(err):  # a listener that cannot bind
            _fail(str(err), code=1)
        first_line = (str(err).strip().splitlines() or [""])[0]
        _fail(f"{type(err).__name__}: {first_line} (--log-level debug shows the traceback)", 1)


if __name__ == "__main__":
    main()
