"""Helpers for the deployment's tests: the Kubernetes overlays rendered by kustomize, and their objects."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

# The end-to-end fixtures: a Redis of the test's own and real worker processes.
from tests.worker.conftest import server, workers  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-tp")


def kustomize_command() -> list[str] | None:
    """kubectl's built-in kustomize, else a standalone kustomize; None where neither is installed."""
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


@functools.cache
def _rendered(overlay: str) -> str:
    cmd = kustomize_command()
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize is installed: the overlays cannot be rendered here")
    out = subprocess.run([*cmd, str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kustomize failed on overlays/{overlay}:\n{out.stderr}"
    return out.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects, as `kubectl apply -k` would send them (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(_rendered(overlay)) if doc]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    """The value after `name` in a container's args."""
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]
