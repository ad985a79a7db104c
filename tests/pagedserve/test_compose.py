"""docker-compose.yml: the structure the README promises, and valid for the compose CLI when one is installed."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_has_redis_gateway_gpu_workers_and_a_cpu_profile():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = spec["services"]
    assert "healthcheck" in services["redis"]
    assert services["gateway"]["ports"] and services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "ports" not in services["worker"]  # so --scale worker=N does not collide
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert spec["volumes"]["models"] is not None or "models" in spec["volumes"]
    for name in ("gateway", "worker", "worker-cpu"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"


@pytest.mark.skipif(not (shutil.which("docker-compose") or shutil.which("docker")), reason="no compose CLI")
def test_compose_config_validates():
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]):
            result = subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "--profile", "cpu", "config", "--services"],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                assert set(result.stdout.split()) == {"redis", "gateway", "worker", "worker-cpu"}
                return
    pytest.skip("no working compose CLI (docker without the compose plugin)")
