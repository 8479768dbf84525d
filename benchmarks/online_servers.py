"""Starts a server for the online benchmark and stops it after: pagedserve's two services with
their defaults (scripts/local_services.py), or `vllm serve`'s API server on dummy weights of the
same preset's shape (vllm_preset.py's config.json) from its own site folder (install_on_gpu.sh of
../shared/bench/vllm).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# As offline_bench.py sets them: flashinfer is not installed (its sampler would fail the engine at
# load), and the machine reaches no network.
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_START_TIMEOUT_S = 300  # engine start, torch.compile and graph capture
# pagedserve's JSON grammar exactly (llguidance, compact), so a schema costs both servers the same
# tokens. vLLM's default backend, xgrammar for these schemas, lets a random-weight model pad
# whitespace without end, and without it writes ", " / ": " and any split of fixed text: longer.
VLLM_STRUCTURED_OUTPUTS = {"backend": "guidance", "disable_any_whitespace": True}


@contextlib.contextmanager
def launch_ours(model: str, log_dir: Path, executor_args: list[str] = (),
                scheduler_args: list[str] = ()):
    """Both services on free ports, defaults but for the model; yields the HTTP API's URL."""
    from scripts.local_services import start_services

    log_dir.mkdir(parents=True, exist_ok=True)
    services = start_services(log_dir, ["--model", model, *executor_args], list(scheduler_args))
    try:
        yield services.http_url
    finally:
        services.stop()


@contextlib.contextmanager
def launch_vllm(model: str, log_dir: Path, site: str, server_args: list[str] = (),
                tokenizer: str | None = None):
    """vLLM's OpenAI API server on dummy weights of `model`'s shape (a preset), token ids in and
    out (no tokenizer), with vLLM's defaults; yields its URL once /v1/models answers. With a
    tokenizer folder (structured output needs one), that tokenizer, and VLLM_STRUCTURED_OUTPUTS:
    JSON grammars as pagedserve compiles them."""
    from benchmarks.vllm_preset import hub_config
    from scripts.local_services import free_port

    model_dir = log_dir / "vllm_model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = hub_config(model.removeprefix("preset:"))
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own site only
    env["PYTHONPATH"] = site
    env.update({k: v for k, v in VLLM_ENV.items() if k not in os.environ})
    tokens = (["--tokenizer", tokenizer, "--structured-outputs-config",
               json.dumps(VLLM_STRUCTURED_OUTPUTS)] if tokenizer
              else ["--skip-tokenizer-init"])
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--load-format", "dummy", *tokens, "--seed", "0",
           "--host", "127.0.0.1", "--port", str(port), *server_args]
    log = log_dir / "vllm_server.log"
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    # A session of its own: stopping it ends the engine processes it starts too.
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc, log, VLLM_START_TIMEOUT_S)
        yield url
    finally:
        _stop_group(proc)


def wait_http_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Polls GET /v1/models until it answers 200; raises with the log's end if the process
    exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it "
                               f"served:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not serve within {timeout:.0f} s:\n{_tail(log)}")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group; after 30 s, or once it has exited, SIGKILL to
    whatever of the group is left (an engine process outliving its server holds the GPU)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, num_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except FileNotFoundError:
        return f"({path}: no log)"
