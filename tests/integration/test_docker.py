"""The images built from docker/*.Dockerfile, run as docker-compose.yml describes on a real Docker
engine: the scheduler and the CPU executor serve Generate, and restarting the executor's container
with requests in flight fails none of them.

No registry is needed: scripts/docker_local_images.sh builds a local base image, then the project's
images through docker/compose.host-network.yml (every container on the host's network). Skipped
where no engine answers, unless PAGEDSERVE_REQUIRE_DOCKER=1 (CI sets it) makes that a failure.
"""
from __future__ import annotations

import os
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
from tests.integration.test_end_to_end import random_prompts
from tests.integration.test_resilience import Load

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["-f", "docker-compose.yml", "-f", "docker/compose.host-network.yml"]
BUILD_TIMEOUT_S = 1800  # a cold build: base image, torch, both images' dependencies

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + 600)]


def _compose_command() -> list[str] | None:
    """`docker compose` (v2) where the plugin is installed, else `docker-compose` (v1)."""
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


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
    """The running compose project: its command line and environment, its merged configuration,
    and a Services view of it."""

    compose: list[str]
    env: dict[str, str]
    config: dict
    services: Services

    def run(self, *args: str, check: bool = True, timeout: float = 300):
        result = subprocess.run([*self.compose, *args], cwd=ROOT, env=self.env,
                                capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0 or not check, f"{args}: {result.stderr[-4000:]}"
        return result


def _host_network_config(compose: list[str], env: dict[str, str]) -> dict:
    """docker-compose.yml with the host-network override, merged by compose itself, less the
    published ports: on the host's network there is nothing to publish (v1 refuses them)."""
    merged = subprocess.run([*compose, *COMPOSE_FILES, "--profile", "cpu", "config"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    config = yaml.safe_load(merged.stdout)
    for service in config["services"].values():
        service.pop("ports", None)
    return config


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
    ports = {name: free_port() for name in ("SCHEDULER_PORT", "EXECUTOR_PORT", "ADMIN_PORT",
                                            "METRICS_PORT", "HTTP_PORT")}
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}}
    compose = _compose_command()
    config = _host_network_config(compose, env)
    compose_file = tmp_path_factory.mktemp("compose") / "docker-compose.yml"
    compose_file.write_text(yaml.safe_dump(config, sort_keys=False))
    compose += ["-p", f"pagedserve-test-{os.getpid()}", "-f", str(compose_file)]
    services = Services(f"127.0.0.1:{ports['SCHEDULER_PORT']}",
                        f"127.0.0.1:{ports['EXECUTOR_PORT']}", ports["METRICS_PORT"],
                        f"127.0.0.1:{ports['ADMIN_PORT']}")
    deployed = Deployment(compose, env, config, services)
    failed_before = request.session.testsfailed
    try:
        deployed.run("--profile", "cpu", "up", "-d", "scheduler", "executor-cpu")
        wait_serving(services.scheduler_address)
        yield deployed
    except BaseException:
        failed_before = -1
        raise
    finally:
        if request.session.testsfailed != failed_before:  # the containers' logs, for the report
            print(subprocess.run([*compose, "logs", "--no-color"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120).stdout[-20000:])
        subprocess.run([*compose, "--profile", "cpu", "down", "-v", "--remove-orphans", "-t", "5"],
                       cwd=ROOT, env=env, capture_output=True, timeout=300)


def test_the_images_serve_generate(deployment):
    with grpc.insecure_channel(deployment.services.scheduler_address) as channel:
        ids, text, final = generate(deployment.services.stub(channel), text="Hello", max_tokens=8)
    assert len(ids) == 8 and final.finished and text
    for name in ("scheduler", "executor-cpu"):  # the compose file's healthchecks, run in place
        healthcheck = deployment.config["services"][name]["healthcheck"]["test"]
        deployment.run("exec", "-T", name, *healthcheck[1:])
    no_torch = deployment.run("exec", "-T", "scheduler", "python", "-c", "import torch",
                              check=False)
    assert "No module named 'torch'" in no_torch.stdout + no_torch.stderr


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
