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
        ["docker", "compose", "-f", str(COMPOSE), "--profile", "cpu", "--profile", "tools", "--profile", "monitoring",
         "config", "-q"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_compose_services_volumes_gpu_and_profiles() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == {
        "redis",
        "worker",
        "worker-tp",
        "worker-cpu",
        "producer",
        "prometheus",
        "grafana",
    }
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
        "--metrics-port",
        "9400",
    ]
    # one model over four GPUs: the worker's rank processes beside it, NCCL's buffers in /dev/shm
    tp = services["worker-tp"]
    assert (
        tp["profiles"] == ["tp"] and tp["command"][tp["command"].index("--tensor-parallel-size") + 1] == "4"
    )
    assert tp["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4 and tp["shm_size"]
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["command"][-4:] == ["--device", "cpu", "--metrics-port", "9400"]
    assert services["producer"]["profiles"] == ["tools"] and services["producer"]["entrypoint"] == [
        "producer"
    ]


def test_monitoring_profile_scrapes_every_worker_and_provisions_the_dashboard() -> None:
    root = COMPOSE.parent
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    assert prom["profiles"] == grafana["profiles"] == ["monitoring"]
    # Every volume the two services mount from the repository exists there.
    for volume in prom["volumes"] + grafana["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (root / source).exists(), source
    scrape = yaml.safe_load((root / "configs" / "prometheus.yml").read_text())["scrape_configs"]
    (dns,) = [sd for job in scrape for sd in job.get("dns_sd_configs", [])]
    # It scrapes both worker services on the port their command serves metrics on.
    assert set(dns["names"]) == {"worker", "worker-cpu"} and dns["port"] == 9400
    datasources = yaml.safe_load(
        (root / "configs/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    (ds,) = datasources["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    providers = yaml.safe_load((root / "configs/grafana/provisioning/dashboards/batchq.yml").read_text())
    dashboards_dir = providers["providers"][0]["options"]["path"]
    assert any(v.endswith(f":{dashboards_dir}:ro") for v in grafana["volumes"])
    assert (root / "configs/grafana/dashboards/batchq.json").is_file()
