"""Starts the executor and the scheduler as real processes on localhost, each on a free port, for
the integration tests and benchmarks/bench_serving.py. Readiness is awaited through the health
Watch stream, never by sleeping. Imports neither service: it only runs them.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import admin_pb2, admin_pb2_grpc, generate_pb2_grpc

START_TIMEOUT_S = 240


# Ports this process handed out: the kernel may give a port just freed to the next bind(0), and
# two listeners of one start must never be handed the same port.
_handed_out: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


# gRPC's default reconnect backoff (1 s, growing 1.6x) would have a waiter find a process that
# started listening between two tries seconds late; awaiting a start retries every 0.1-0.25 s.
_AWAIT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 250)]


class ProcessExited(RuntimeError):
    """A process that had to keep running while something was awaited ended."""


def wait_serving(address: str, timeout: float = START_TIMEOUT_S, service: str = "",
                 procs: dict[str, subprocess.Popen] | None = None) -> None:
    """Blocks until the health service at `address` reports SERVING (streams status changes).
    If one of `procs` ({name: process}) exits first, raises ProcessExited at once rather than
    waiting out `timeout`."""
    with grpc.insecure_channel(address, options=_AWAIT_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                            wait_for_ready=True)
        exited = _cancel_when_one_exits(stream, procs or {})
        try:
            for reply in stream:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    stream.cancel()
                    return
        except grpc.RpcError as err:
            if exited:
                name, proc = exited[0]
                raise ProcessExited(f"the {name} exited with status {proc.returncode} while "
                                    f"{address} was awaited") from None
            raise TimeoutError(f"{address} never reported SERVING: {err.code().name}") from err
    raise TimeoutError(f"{address} never reported SERVING")


def _cancel_when_one_exits(stream, procs: dict[str, subprocess.Popen]) -> list:
    """Cancels `stream` when any of `procs` exits; the list it returns then holds (name, proc).
    One thread per process, blocked in its wait (they end with their processes)."""
    exited: list = []

    def watch(name: str, proc: subprocess.Popen) -> None:
        proc.wait()
        exited.append((name, proc))
        stream.cancel()

    for name, proc in procs.items():
        threading.Thread(target=watch, args=(name, proc), daemon=True,
                         name=f"watch-{name}").start()
    return exited


@dataclass
class Services:
    """A running executor + scheduler pair; `stop()` ends both."""

    scheduler_address: str
    executor_address: str
    metrics_port: int
    admin_address: str = ""
    admin_token: str | None = None
    http_port: int = 0  # the OpenAI HTTP API (0: off)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stub(self, channel: grpc.Channel) -> generate_pb2_grpc.GeneratorStub:
        return generate_pb2_grpc.GeneratorStub(channel)

    def metrics(self) -> dict[str, float]:
        """The scheduler's Prometheus samples, as {'name{labels}': value}."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        samples = {}
        for line in text.splitlines():
            m = re.match(r"^(pagedserve_[^ ]+) ([0-9.e+-]+)$", line)
            if m:
                samples[m.group(1)] = float(m.group(2))
        return samples

    def _admin_metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.admin_token}"),) if self.admin_token else ()

    def status(self) -> admin_pb2.GetStatusResponse:
        with grpc.insecure_channel(self.admin_address) as channel:
            return admin_pb2_grpc.AdminStub(channel).GetStatus(
                admin_pb2.GetStatusRequest(), timeout=10, metadata=self._admin_metadata())

    def set_executors(self, *addresses: str) -> admin_pb2.SetExecutorsResponse:
        with grpc.insecure_channel(self.admin_address) as channel:
            return admin_pb2_grpc.AdminStub(channel).SetExecutors(
                admin_pb2.SetExecutorsRequest(addresses=list(addresses)), timeout=120,
                metadata=self._admin_metadata())

    def add_executor(self, name: str, args: list[str], port: int | None = None,
                     wait: bool = True) -> str:
        """Starts another executor process; returns its address, once it answers health unless
        `wait=False` (then `wait_serving(address)` before using it)."""
        port = port or free_port()
        self.logs[name] = self.logs["executor"].replace("executor.log", f"{name}.log")
        self.procs[name] = start_executor(args, port, self.logs[name])
        address = f"127.0.0.1:{port}"
        if wait:
            wait_serving(address)
        return address

    def log_of(self, name: str) -> str:
        with open(self.logs[name], errors="replace") as f:
            return f.read()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_executor(args: list[str], port: int, log_path: str, env: dict | None = None):
    cmd = [sys.executable, "-m", "executor_svc.main", "--host", "127.0.0.1", "--port", str(port),
           *args]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def start_services(tmp_path, executor_args: list[str] | None, scheduler_args: list[str] = (),
                   extra_executor_addresses: tuple[str, ...] = (),
                   executor_file=None, admin_token: str | None = None,
                   wait: bool = True, scheduler_preexec_fn=None,
                   executor_address: str | None = None) -> Services:
    """Executor, then scheduler (its Admin API on a port of its own, with `admin_token` if given).
    With `executor_file` the scheduler reads its executor addresses from that file
    (`--executor @FILE`, re-read on SIGHUP); it is written here first. `wait=False` returns as
    soon as both processes are started; `executor_args=None` starts no executor: the caller
    starts one at the returned `executor_address` later, or passes `executor_address`, one that
    runs already. `scheduler_preexec_fn` runs in the scheduler's process before it starts (a
    lower open-file limit, say)."""
    sch_port, metrics_port, admin_port = free_port(), free_port(), free_port()
    services = Services(f"127.0.0.1:{sch_port}", executor_address or f"127.0.0.1:{free_port()}",
                        metrics_port, f"127.0.0.1:{admin_port}", admin_token, http_port=free_port())
    executors = ",".join((services.executor_address, *extra_executor_addresses))
    if executor_file is not None:
        executor_file.write_text(executors.replace(",", "\n") + "\n")
        executors = f"@{executor_file}"
    services.logs = {"executor": str(tmp_path / "executor.log"),
                     "scheduler": str(tmp_path / "scheduler.log")}
    if executor_args is not None:
        services.procs["executor"] = start_executor(
            executor_args, int(services.executor_address.rsplit(":", 1)[1]),
            services.logs["executor"])
    cmd = [sys.executable, "-m", "scheduler_svc.main", "--host", "127.0.0.1", "--port",
           str(sch_port), "--admin-port", str(admin_port), "--executor", executors,
           "--metrics-port", str(metrics_port), "--http-port", str(services.http_port),
           *scheduler_args]
    if admin_token:
        cmd += ["--admin-token", admin_token]
    services.procs["scheduler"] = subprocess.Popen(
        cmd, stdout=open(services.logs["scheduler"], "w"), stderr=subprocess.STDOUT,
        preexec_fn=scheduler_preexec_fn)
    if wait:
        wait_started(services)
    return services


def wait_started(services: Services) -> None:
    """Blocks until the scheduler serves; if it never does, one of the processes exits first, or
    what serves at its address is not this scheduler, stops them all and raises with their logs
    (an executor that fails at start ends the wait at once, not after START_TIMEOUT_S)."""
    try:
        wait_serving(services.scheduler_address, procs=dict(services.procs))
        problem = _not_this_scheduler(services)
    except ProcessExited as err:
        problem = f"services did not start: {err}"
    except Exception as err:  # noqa: BLE001 - reported with the logs below
        problem = f"services did not start: {err!r}"
    if problem:
        services.stop()
        raise RuntimeError(f"{problem}:\n" + "\n".join(
            _tail(path) for path in services.logs.values()))


def _tail(path: str, num_chars: int = 3000) -> str:
    """The end of a log file, or a line saying there is none (a process never started)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-num_chars:]
    except FileNotFoundError:
        return f"({path}: no log)"


def _not_this_scheduler(services: Services) -> str | None:
    """Why the SERVING answer was not this scheduler's, or None. free_port() leaves the port free
    until the scheduler binds it, so another process (of another test run on the machine, say)
    can take it meanwhile, and every executor and scheduler answers health alike. The scheduler
    logs where it listens before it serves."""
    if f" listening on {services.scheduler_address} " in services.log_of("scheduler"):
        return None
    return (f"{services.scheduler_address} serves, but this scheduler does not listen there: "
            "another process took the port")
