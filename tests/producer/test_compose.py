"""docker-compose.yml is valid and wires the services the README promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    out = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False)
    return out.returncode == 0


@pytest.mark.skipif(not _compose_available(), reason="docker compose client not installed")
def test_docker_compose_config_is_valid() -> None:
    out = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "--profile", "cpu", "--profile", "tools", "config", "-q"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_compose_services_volumes_gpu_and_profiles() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == {"redis", "worker", "worker-cpu", "producer"}
    redis = services["redis"]
    assert redis["image"] == "redis:7" and "--appendonly" in redis["command"]
    assert redis["volumes"][0].split(":")[0] in spec["volumes"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["worker"]["command"] == [
        "worker",
        "--model",
        "smollm2-135m",
        "--redis-url",
        "redis://redis:6379/0",
    ]
    assert services["worker-cpu"]["profiles"] == ["cpu"] and services["worker-cpu"]["command"][-2:] == [
        "--device",
        "cpu",
    ]
    assert services["producer"]["profiles"] == ["tools"] and services["producer"]["entrypoint"] == [
        "producer"
    ]
