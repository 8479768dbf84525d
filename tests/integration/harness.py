"""Talks to services started as real processes on localhost over gRPC. The starting and stopping
(free_port, Services, start_services, ...) lives in scripts/local_services.py, shared with
benchmarks/bench_serving.py, and is re-exported here for the tests.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from dataclasses import dataclass

import pytest

from protos import generate_pb2
from scripts.local_services import (START_TIMEOUT_S, Services, free_port, start_executor,
                                    start_services, wait_serving, wait_started)

__all__ = ["START_TIMEOUT_S", "LoneExecutor", "Services", "StreamedToken", "attach_scheduler",
           "default_sigint", "free_port", "generate", "openai_client", "signal_another_thread",
           "start_executor", "start_lone_executor", "start_services", "start_services_with",
           "streamed_tokens", "wait_serving", "wait_started"]


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def signal_another_thread(pid: int, sig: int) -> None:
    """`sig` to one of process `pid`'s threads other than its main one (tgkill), as the kernel
    may deliver a process's signal; pytest.skip where tgkill's number is not known here."""
    if _TGKILL is None:
        pytest.skip("tgkill's number is known for x86_64 and aarch64")
    other = next(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_TGKILL, pid, other, sig) == 0, os.strerror(ctypes.get_errno())


def default_sigint() -> None:
    """A Popen preexec_fn for a child that must see Ctrl-C: a child inherits an ignored SIGINT
    (a test run in the background, nohup), and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def openai_client(services: Services, api_key: str = "none", asynchronous: bool = False):
    """The OpenAI SDK's client (AsyncOpenAI with `asynchronous`) on the services' HTTP API, as a
    user makes one, without the SDK's retries (a test sees every failure)."""
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=f"{services.http_url}/v1", api_key=api_key, max_retries=0, timeout=120)


@dataclass(frozen=True)
class LoneExecutor:
    """An executor process started without a scheduler, for schedulers started one after another
    (each stopped before the next, which frees the lease)."""

    address: str
    log: str
    proc: subprocess.Popen

    def wait(self) -> None:
        """Blocks until it serves (raises at once if it exits)."""
        wait_serving(self.address, procs={"executor": self.proc})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def start_lone_executor(tmp_path, args: list[str], wait: bool = True) -> LoneExecutor:
    """An executor on a free port, once serving unless `wait=False` (then `wait()` before use)."""
    port, log = free_port(), str(tmp_path / "executor.log")
    executor = LoneExecutor(f"127.0.0.1:{port}", log, start_executor(args, port, log))
    if wait:
        try:
            executor.wait()
        except BaseException:
            executor.proc.kill()
            raise
    return executor


def attach_scheduler(tmp_path, executor: LoneExecutor, scheduler_args: list[str] = (),
                     **kwargs) -> Services:
    """start_services' scheduler alone, attached to `executor` (no other scheduler may hold it):
    what a test that needs only its own scheduler flags starts. `stop()` ends the scheduler."""
    services = start_services(tmp_path, None, scheduler_args, wait=False,
                              executor_address=executor.address, **kwargs)
    services.logs["executor"] = executor.log
    wait_started(services)
    return services


def start_services_with(tmp_path, executor_args: list[str], scheduler_args: list[str] = (),
                        others: dict[str, list[str]] | None = None,
                        **kwargs) -> tuple[Services, list[str]]:
    """start_services, and the executors of `others` ({name: args}, none of them among the
    scheduler's addresses) started at the same time rather than one after another: (services,
    the others' addresses), everything serving."""
    services = start_services(tmp_path, executor_args, scheduler_args, wait=False, **kwargs)
    try:
        addresses = [services.add_executor(name, args, wait=False)
                     for name, args in (others or {}).items()]
        wait_started(services)
        for address in addresses:
            wait_serving(address)
    except BaseException:
        services.stop()
        raise
    return services, addresses


def generate(stub, prompt_ids: list[int] | None = None, text: str | None = None,
             max_tokens: int = 16, ignore_eos: bool = True, timeout: float = 300, **sampling):
    """Runs one Generate call; returns (token ids, text, final message)."""
    req = generate_pb2.GenerateRequest()
    if prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    else:
        req.text = text
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = ignore_eos
    for key, value in sampling.items():
        setattr(req.sampling, key, value)
    ids, pieces, final = [], [], None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.finished:
            final = msg
            pieces.append(msg.text)
        else:
            assert msg.index == len(ids)
            ids.extend(msg.token_ids)
            pieces.append(msg.text)
    return ids, "".join(pieces), final


@dataclass(frozen=True)
class StreamedToken:
    """One token of Generate's token messages, which carry one token or several."""

    token_id: int
    logprob: float | None  # with the top ones', when the request asked for logprobs
    top_logprobs: list  # TokenLogprob messages, most likely first
    message: int  # which token message carried it (0-based)


def streamed_tokens(messages) -> list[StreamedToken]:
    """Every token of the token messages among `messages`, in order."""
    out = []
    for number, msg in enumerate(m for m in messages if not m.finished):
        assert not msg.logprobs or len(msg.logprobs) == len(msg.token_ids), msg
        for i, token_id in enumerate(msg.token_ids):
            entry = msg.logprobs[i] if msg.logprobs else None
            out.append(StreamedToken(token_id, entry.logprob if entry else None,
                                     list(entry.top) if entry else [], number))
    return out
