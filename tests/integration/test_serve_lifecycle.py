"""`make serve`'s launcher (scripts/serve.py) as a real process: Ctrl-C and SIGTERM drain the
scheduler before the executor stops (SIGTERM also through `make serve`), and an executor that
fails at start ends it with its error. And what the pair does when its executor hangs (SIGSTOP),
then resumes (SIGCONT)."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generate_pb2, generate_pb2_grpc
from tests.integration.harness import (free_port, signal_another_thread, start_services,
                                       wait_serving)
from tests.integration.test_end_to_end import TINY, assert_pools_whole, random_prompts
from tests.integration.test_resilience import Load

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "serve.py"
MAX_TOKENS = 400


def start_launcher(tmp_path, executor_args: str,
                   through_make: bool = False) -> tuple[subprocess.Popen, str, Path]:
    """(launcher process, or `make serve` running it, scheduler address, log file with
    everything they printed). `make` gets `-o .venv/bin/.installed`: it installs nothing."""
    ex_port, sch_port, admin_port = free_port(), free_port(), free_port()
    log = tmp_path / "serve.log"
    executor_args = f"--port {ex_port} --backend cpu {executor_args}"
    scheduler_args = (f"--port {sch_port} --admin-port {admin_port} --http-port 0 "
                      f"--executor 127.0.0.1:{ex_port} --shutdown-timeout 60")
    if through_make:
        cmd = ["make", "-s", "-o", ".venv/bin/.installed", "serve",
               f"EXECUTOR_ARGS={executor_args}", f"SCHEDULER_ARGS={scheduler_args}"]
    else:
        cmd = [sys.executable, str(LAUNCHER), "--executor-args", executor_args,
               "--scheduler-args", scheduler_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{sch_port}", log


def stream_tokens(address: str, first_token: threading.Event, out: dict) -> None:
    """One Generate call of MAX_TOKENS tokens; sets `first_token` when the first arrives."""
    req = generate_pb2.GenerateRequest()
    req.token_ids.ids.extend(range(1, 17))
    req.stopping.max_tokens = MAX_TOKENS
    req.stopping.ignore_eos = True
    out["ids"] = []
    with grpc.insecure_channel(address) as channel:
        for msg in generate_pb2_grpc.GeneratorStub(channel).Generate(req, timeout=120):
            if msg.finished:
                out["final"] = msg
            else:
                out["ids"].extend(msg.token_ids)
                first_token.set()


@pytest.mark.parametrize("sig,through_make", [(signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["ctrl-c", "sigterm-to-make"])
def test_signal_drains_then_stops_executor(tmp_path, sig, through_make):
    """SIGINT to the launcher (a terminal's Ctrl-C reaches make's whole group: the first five
    minutes' test); SIGTERM to make's pid alone, which make passes on to the launcher."""
    if through_make and shutil.which("make") is None:
        pytest.skip("no make")
    proc, address, log = start_launcher(tmp_path, "--model preset:tiny", through_make)
    try:
        wait_serving(address)
        first_token, out = threading.Event(), {}
        reader = threading.Thread(target=stream_tokens, args=(address, first_token, out))
        reader.start()
        assert first_token.wait(60)
        proc.send_signal(sig)
        reader.join(120)
        # make, killed by the signal it passed on, ends by it once the launcher has exited
        assert proc.wait(60) == (-sig if through_make else 0), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert out["final"].finish_reason == generate_pb2.FINISH_REASON_LENGTH, text[-3000:]
    assert len(out["ids"]) == MAX_TOKENS
    draining = text.index("shutting down: draining 1 requests")
    scheduler_exit = text.index("scheduler exited (status 0); stopping the executor")
    executor_exit = text.index("executor exited (status 0)")
    assert draining < scheduler_exit < executor_exit
    assert "Traceback" not in text


def test_sigterm_taken_by_a_watcher_thread_still_stops_the_launcher(tmp_path):
    """The kernel may hand the launcher's SIGTERM to one of its threads (a child's watcher): its
    main thread, waiting on them, must still run the handler."""
    proc, address, log = start_launcher(tmp_path, "--model preset:tiny")
    try:
        wait_serving(address)
        signal_another_thread(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert text.index("SIGTERM: draining the scheduler") < text.index("executor exited (status 0)")


def test_executor_start_error_ends_launcher(tmp_path):
    proc, _, log = start_launcher(tmp_path, f"--model {tmp_path / 'missing.gguf'}")
    try:
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 2, text
    assert "pagedserve-executor: error: --model" in text and "no such file or folder" in text
    assert "the executor exited while starting (status 2)" in text
    assert "Traceback" not in text


def wait_not_serving(address: str, timeout: float) -> None:
    """Blocks until the health service at `address` reports NOT_SERVING."""
    with grpc.insecure_channel(address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                           timeout=timeout)
        for reply in stream:
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                stream.cancel()
                return


def test_a_hung_executor_is_noticed_and_taken_back_when_it_resumes(tmp_path):
    """SIGSTOP (hung, not dead): within --step-timeout the scheduler counts the executor as lost
    (health NOT_SERVING) and keeps trying it; after SIGCONT it attaches the same executor again
    and every stream completes with transformers' tokens, none duplicated or missing."""
    step_timeout_s = 2.0
    services = start_services(tmp_path, ["--model", TINY],
                              ["--step-timeout", str(step_timeout_s),
                               "--executor-connect-timeout", "1",
                               "--executor-retry-interval", "0.5"])
    executor = services.procs["executor"]
    try:
        load = Load(services.scheduler_address, random_prompts(8, seed=11), max_tokens=48,
                    reference=TINY)
        load.wait_tokens(40)
        executor.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_not_serving(services.scheduler_address, timeout=60)
            noticed_after = time.monotonic() - stopped_at
            tokens_while_hung = load.tokens
        finally:
            executor.send_signal(signal.SIGCONT)
        wait_serving(services.scheduler_address, timeout=60)
        load.check_against_reference()
        status = services.status()
        assert status.executor_address == services.executor_address and status.resyncs >= 1
        assert tokens_while_hung < 8 * 48  # it was noticed with streams still running
        assert noticed_after < step_timeout_s + 10, noticed_after
        assert "no result for step" in services.log_of("scheduler")
        assert_pools_whole(services)
    finally:
        services.stop()
