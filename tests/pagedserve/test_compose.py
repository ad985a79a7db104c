"""docker-compose.yml: the structure the README promises, checked against the rules of the compose
file format it uses (a checker that is itself shown to fail on broken files), and by the compose
CLI wherever one with the compose plugin is installed."""

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICE_KEYS = {"image", "build", "restart", "volumes", "environment", "depends_on", "command", "ports",
                "healthcheck", "deploy", "profiles", "stop_grace_period"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
DURATION = re.compile(r"^\d+(ms|s|m|h)$")
PORT = re.compile(r"^(\$\{[A-Z_]+(:-\d+)?\}|\d+):\d+$")


def load() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def problems(spec: dict) -> list[str]:
    """What the compose format rejects or what would fail at `up`, for the keys this file uses."""
    found = [f"top-level key {k!r}" for k in spec if k not in ("services", "volumes") and not k.startswith("x-")]
    services, volumes = spec.get("services") or {}, spec.get("volumes") or {}
    for name, svc in services.items():
        found += [f"{name}: unknown key {k!r}" for k in svc if k not in SERVICE_KEYS]
        if "image" not in svc and "build" not in svc:
            found.append(f"{name}: neither image nor build")
        if not (isinstance(svc.get("command", []), list) and all(isinstance(c, str) for c in svc.get("command", []))):
            found.append(f"{name}: command must be a list of strings")
        for target, dep in (svc.get("depends_on") or {}).items():
            if target not in services:
                found.append(f"{name}: depends on unknown service {target!r}")
            elif dep.get("condition") not in CONDITIONS:
                found.append(f"{name}: bad condition {dep.get('condition')!r}")
            elif dep["condition"] == "service_healthy" and "healthcheck" not in services[target]:
                found.append(f"{name}: waits for {target} to be healthy, which has no healthcheck")
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if not source.startswith(("/", ".")) and source not in volumes:
                found.append(f"{name}: volume {source!r} is not declared")
        found += [f"{name}: port {p!r}" for p in svc.get("ports", []) if not PORT.match(str(p))]
        found += [f"{name}: environment {k} is not a string" for k, v in (svc.get("environment") or {}).items()
                  if not isinstance(v, str)]
        check = svc.get("healthcheck")
        if check is not None:
            if not (isinstance(check.get("test"), list) and check["test"][0] in ("CMD", "CMD-SHELL")):
                found.append(f"{name}: healthcheck test must be [CMD, ...] or [CMD-SHELL, ...]")
            found += [f"{name}: healthcheck {k} {check[k]!r}" for k in ("interval", "timeout")
                      if k in check and not DURATION.match(str(check[k]))]
        if "stop_grace_period" in svc and not DURATION.match(str(svc["stop_grace_period"])):
            found.append(f"{name}: stop_grace_period {svc['stop_grace_period']!r}")
    return found


def test_the_file_follows_the_format():
    assert problems(load()) == []


@pytest.mark.parametrize("break_it, expected", [
    (lambda s: s["services"]["gateway"].update(port=["8000:8000"]), "unknown key 'port'"),
    (lambda s: s["services"]["gateway"]["depends_on"].update(cache={"condition": "service_started"}), "unknown service 'cache'"),
    (lambda s: s["services"]["worker"].update(volumes=["weights:/w"]), "volume 'weights' is not declared"),
    (lambda s: s["services"]["gateway"].update(ports=["eighty:8000"]), "port 'eighty:8000'"),
    (lambda s: s["services"]["redis"].pop("healthcheck"), "which has no healthcheck"),
    (lambda s: s["services"]["worker"].update(stop_grace_period="a minute"), "stop_grace_period"),
])
def test_the_checker_rejects_broken_files(break_it, expected):
    spec = copy.deepcopy(load())
    break_it(spec)
    assert any(expected in p for p in problems(spec)), problems(spec)


def test_compose_has_redis_gateway_gpu_workers_and_a_cpu_profile():
    spec = load()
    services = spec["services"]
    assert "healthcheck" in services["redis"]
    assert services["gateway"]["ports"] and services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "ports" not in services["worker"]  # so --scale worker=N does not collide
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert "models" in spec["volumes"]
    for name in ("gateway", "worker", "worker-cpu"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"


def compose_cli() -> list[str] | None:
    """A compose CLI that works (docker with the compose plugin, or docker-compose), else None."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


@pytest.mark.skipif(compose_cli() is None, reason="no compose CLI (docker without the compose plugin)")
def test_compose_config_validates():
    result = subprocess.run([*compose_cli(), "-f", str(ROOT / "docker-compose.yml"), "--profile", "cpu", "config",
                             "--services"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {"redis", "gateway", "worker", "worker-cpu"}
