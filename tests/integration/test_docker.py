"""The images built from docker/*.Dockerfile, run as docker-compose.yml describes on a real Docker
engine: the scheduler and the CPU executor serve Generate, and restarting the executor's container
with requests in flight fails none of them.

No registry is needed: scripts/docker_local_images.sh builds a local base image, then the project's
images through docker/compose.host-network.yml (every container on the host's network), whose
documented command is then run as written; ports and project name come from the environment it
reads. Skipped where no engine answers, unless PAGEDSERVE_REQUIRE_DOCKER=1 (CI sets it) makes that
a failure.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from protos import generate_pb2
from tests.integration.harness import Services, free_port, generate, wait_serving
from tests.integration.readme_curl import assert_readme_curl_answered
from tests.integration.test_end_to_end import random_prompts
from tests.integration.test_resilience import Load

ROOT = Path(__file__).resolve().parents[2]
HOST_NETWORK_FILE = ROOT / "docker" / "compose.host-network.yml"
BUILD_TIMEOUT_S = 1800  # a cold build: base image, torch, both images' dependencies

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + 600)]


def documented_command() -> list[str]:
    """The command docker/compose.host-network.yml's header says to run, as written there."""
    lines = HOST_NETWORK_FILE.read_text().splitlines()
    commands = [line.lstrip("# ") for line in lines
                if line.startswith("#   docker-compose ") or line.startswith("#   docker compose ")]
    assert len(commands) == 1, f"one command in {HOST_NETWORK_FILE.name}'s header: {commands}"
    return shlex.split(commands[0])


def _compose_command() -> list[str] | None:
    """The documented command, run by `docker compose` (v2) where `docker-compose` (v1, which it
    names) is not installed (the file's header says v2 takes the same arguments)."""
    command = documented_command()
    if shutil.which(command[0]):
        return command
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return ["docker", "compose", *command[1:]] if probe.returncode == 0 else None


def _engine_problem() -> str | None:
    """Why no image can be built and run here, or None."""
    if shutil.which("docker") is None:
        return "no docker command"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return "no Docker engine answers: " + (info.stderr.strip().splitlines() or ["?"])[-1]
    if _compose_command() is None:
        return "neither `docker compose` nor `docker-compose` is installed"
    base = os.environ.get("PAGEDSERVE_BASE_IMAGE", "pagedserve-base:bookworm")
    has_base = subprocess.run(["docker", "image", "inspect", base], capture_output=True,
                              timeout=60).returncode == 0
    if not has_base and (os.geteuid() != 0 or shutil.which("debootstrap") is None):
        return f"no base image {base}, and debootstrap (as root) to make one"
    return None


@dataclass
class Deployment:
    """The running compose project: the documented `up`, its compose options (to run other
    commands on the same project), its environment, its merged configuration, and a Services
    view of it."""

    up: subprocess.Popen
    compose: list[str]
    env: dict[str, str]
    config: dict
    services: Services

    def run(self, *args: str, check: bool = True, timeout: float = 300):
        result = subprocess.run([*self.compose, *args], cwd=ROOT, env=self.env,
                                capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0 or not check, f"{args}: {result.stderr[-4000:]}"
        return result


def _start(command: list[str], env: dict[str, str], log: Path) -> Deployment:
    """Runs `command` (an `up` in the foreground, as a user runs it) and returns at once."""
    compose = command[:command.index("up")]
    merged = subprocess.run([*compose, "config"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    config = yaml.safe_load(merged.stdout)
    up = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          stdout=open(log, "w"), stderr=subprocess.STDOUT)
    services = Services(f"127.0.0.1:{env['SCHEDULER_PORT']}", f"127.0.0.1:{env['EXECUTOR_PORT']}",
                        int(env["METRICS_PORT"]), f"127.0.0.1:{env['ADMIN_PORT']}")
    return Deployment(up, compose, env, config, services)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, request):
    problem = _engine_problem()
    if problem and os.environ.get("PAGEDSERVE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"PAGEDSERVE_REQUIRE_DOCKER=1 but {problem}")
    if problem:
        pytest.skip(problem)
    built = subprocess.run([str(ROOT / "scripts" / "docker_local_images.sh")], cwd=ROOT,
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    ports = {name: str(free_port()) for name in ("SCHEDULER_PORT", "EXECUTOR_PORT", "ADMIN_PORT",
                                                 "METRICS_PORT", "HTTP_PORT")}
    env = {**os.environ, **ports, "COMPOSE_PROJECT_NAME": f"pagedserve-test-{os.getpid()}"}
    log = tmp_path_factory.mktemp("compose") / "up.log"
    deployed = _start(_compose_command(), env, log)
    failed_before = request.session.testsfailed
    try:
        wait_serving(deployed.services.scheduler_address, procs={"compose up": deployed.up})
        yield deployed
    except BaseException:
        failed_before = -1
        raise
    finally:
        if request.session.testsfailed != failed_before:  # compose's and the containers' output
            print(log.read_text()[-20000:])
        deployed.run("down", "-v", "--remove-orphans", "-t", "5", check=False)
        try:
            deployed.up.wait(60)
        finally:
            deployed.up.kill()


def test_the_documented_command_publishes_nothing(deployment):
    """On the host's network nothing is published (compose 1.29 refuses ports there): the
    merged configuration has none, and `up` is still running."""
    assert all("ports" not in service for service in deployment.config["services"].values())
    assert deployment.up.poll() is None


def test_the_images_serve_generate(deployment):
    with grpc.insecure_channel(deployment.services.scheduler_address) as channel:
        ids, text, final = generate(deployment.services.stub(channel), text="Hello", max_tokens=8)
    assert len(ids) == 8 and final.finished and text
    assert_readme_curl_answered(int(deployment.env["HTTP_PORT"]))
    for name in ("scheduler", "executor-cpu"):  # the compose file's healthchecks, run in place
        healthcheck = deployment.config["services"][name]["healthcheck"]["test"]
        deployment.run("exec", "-T", name, *healthcheck[1:])
    no_torch = deployment.run("exec", "-T", "scheduler", "python", "-c", "import torch",
                              check=False)
    assert "No module named 'torch'" in no_torch.stdout + no_torch.stderr


def test_the_scheduler_image_exports_the_tokenizer(deployment):
    """README's tokenizer export, in the image without torch, for the model the volume holds."""
    deployment.run("exec", "-T", "scheduler", "pagedserve-export-tokenizer", "/tmp/tok")
    config = deployment.run("exec", "-T", "scheduler", "cat", "/tmp/tok/tokenizer_config.json")
    assert "chat_template" in yaml.safe_load(config.stdout)


def test_executor_restart_fails_no_request(deployment):
    """Every stream is under way when the executor's container restarts; each still gets all its
    tokens, in order, once: the scheduler re-sends its work to the restarted executor."""
    num_streams, max_tokens = 12, 40
    load = Load(deployment.services.scheduler_address, random_prompts(num_streams, seed=5),
                max_tokens)
    finished_at = {}
    for i, future in enumerate(load.futures):
        future.add_done_callback(lambda _, i=i: finished_at.setdefault(i, time.monotonic()))
    load.wait_tokens(num_streams)
    deployment.run("restart", "-t", "10", "executor-cpu")
    restarted_at = time.monotonic()  # the old executor is gone by now
    for ids, final in load.results():
        assert len(ids) == max_tokens and final.completion_tokens == max_tokens
        assert final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert min(finished_at.values()) > restarted_at, "a stream ended before the restart"
    assert deployment.services.status().resyncs >= 1
