"""The Dockerfile, docker-compose.yml and .dockerignore, read statically (no Docker daemon here): the
targets compose builds exist, the producer image holds no torch, the CPU image takes torch's CPU wheel,
the workers run unprivileged with a health check and a cache volume, and the compose file keeps to what
Compose v1 (1.29, Debian's) reads as well as v2."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import ROOT
from worker.cache_dir import cache_dir
from worker.config import WorkerConfig

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
WORKER_TARGETS = ("cpu", "cuda")
TARGETS = (*WORKER_TARGETS, "producer")

# What Compose v1.29 accepts (its compose/config/compose_spec.json; v2 accepts all of it too).
COMPOSE_V1_TOP = {"version", "services", "networks", "volumes", "secrets", "configs"}
COMPOSE_V1_SERVICE = {
    "deploy", "build", "blkio_config", "cap_add", "cap_drop", "cgroup_parent", "command", "configs",
    "container_name", "cpu_count", "cpu_percent", "cpu_shares", "cpu_quota", "cpu_period", "cpu_rt_period",
    "cpu_rt_runtime", "cpus", "cpuset", "credential_spec", "depends_on", "device_cgroup_rules", "devices", "dns",
    "dns_opt", "dns_search", "domainname", "entrypoint", "env_file", "environment", "expose", "extends",
    "external_links", "extra_hosts", "group_add", "healthcheck", "hostname", "image", "init", "ipc", "isolation",
    "labels", "links", "logging", "mac_address", "mem_limit", "mem_reservation", "mem_swappiness",
    "memswap_limit", "network_mode", "networks", "oom_kill_disable", "oom_score_adj", "pid", "pids_limit",
    "platform", "ports", "privileged", "profiles", "pull_policy", "read_only", "restart", "runtime", "scale",
    "security_opt", "shm_size", "secrets", "sysctls", "stdin_open", "stop_grace_period", "stop_signal",
    "storage_opt", "tmpfs", "tty", "ulimits", "user", "userns_mode", "volumes", "volumes_from", "working_dir",
}  # fmt: skip
COMPOSE_V1_BUILD = {"context", "dockerfile", "args", "labels", "cache_from", "network", "target", "shm_size",
                    "extra_hosts", "isolation"}  # fmt: skip
COMPOSE_V1_HEALTHCHECK = {"disable", "interval", "retries", "test", "timeout", "start_period"}
COMPOSE_V1_GPU = {"capabilities", "count", "device_ids", "driver", "options"}
COMPOSE_V1_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@dataclass
class Stage:
    name: str
    base: str
    lines: list[tuple[str, str]] = field(default_factory=list)  # (instruction, arguments)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def parse() -> tuple[dict[str, str], dict[str, Stage]]:
    """The global ARG defaults, and the stages by name."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", rest, re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            assert m.group(2) not in stages, f"stage {m.group(2)} twice"
            current = stages[m.group(2)] = Stage(m.group(2), m.group(1))
        elif current is None:
            assert word == "ARG", f"{word} before the first FROM"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            current.lines.append((word, rest))
    return args, stages


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, oldest first."""
    out = [stages[name]]
    while out[0].base in stages:
        out.insert(0, stages[out[0].base])
    return out


def last(stages: dict[str, Stage], target: str, word: str) -> str | None:
    values = [rest for s in chain(stages, target) for w, rest in s.lines if w == word]
    return values[-1] if values else None


def runs(stages: dict[str, Stage], target: str) -> list[str]:
    """Every RUN that shapes the target: its own chain's and those of the stages it copies from."""
    out: list[str] = []
    for s in chain(stages, target):
        for word, rest in s.lines:
            m = re.match(r"--from=(\S+)", rest) if word == "COPY" else None
            if m:
                out += runs(stages, m.group(1))
            elif word == "RUN":
                out.append(rest)
    return out


def makefile_default(name: str) -> str:
    m = re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert m, name
    return m.group(1)


def test_the_dockerfile_has_the_targets_compose_builds_and_copies_only_from_earlier_stages() -> None:
    _, stages = parse()
    assert set(TARGETS) <= set(stages)
    seen: set[str] = set()
    for s in stages.values():
        for word, rest in s.lines:
            m = re.match(r"--from=(\S+)", rest) if word == "COPY" else None
            assert m is None or m.group(1) in seen, f"{s.name}: COPY {rest}"
        seen.add(s.name)


@pytest.mark.parametrize("target", TARGETS)
def test_every_image_runs_unprivileged_under_tini(target: str) -> None:
    _, stages = parse()
    user = last(stages, target, "USER")
    assert user is not None and user.split(":")[0] not in ("root", "0")
    assert json.loads(last(stages, target, "ENTRYPOINT") or "[]")[0] == "tini"


def test_the_producer_image_installs_the_producer_side_only() -> None:
    _, stages = parse()
    installs = " ".join(runs(stages, "producer"))
    assert "pip install /src" in installs
    assert "torch" not in installs and "[worker]" not in installs
    assert last(stages, "producer", "HEALTHCHECK") == "NONE"


@pytest.mark.parametrize("target", WORKER_TARGETS)
def test_worker_images_install_torch_then_the_worker_extra_and_check_their_health(target: str) -> None:
    args, stages = parse()
    installs = runs(stages, target)
    pips = [shlex.split(part) for cmd in installs for part in cmd.split("&&") if "pip install" in part]
    torch = next(i for i, p in enumerate(pips) if '"torch==${TORCH_VERSION}"' in shlex.join(p) or
                 "torch==${TORCH_VERSION}" in p)  # fmt: skip
    worker = next(i for i, p in enumerate(pips) if "/src[worker]" in p)
    assert torch < worker  # '.[worker]' finds torch installed and pulls no other build
    # CPU: the CPU wheel index, the version the Makefile installs on CPU machines; CUDA: the default wheel.
    assert args["TORCH_VERSION"] == makefile_default("TORCH_CPU_VERSION")
    index = pips[torch][pips[torch].index("--index-url") + 1] if "--index-url" in pips[torch] else None
    assert index == ("${TORCH_CPU_INDEX}" if target == "cpu" else None)
    assert args["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["SMOLLM2_VERSION"] == makefile_default("SMOLLM2_VERSION")
    # The CPU kernels and Triton's launchers are compiled at run time: the compiler is in the final image.
    runtime = " ".join(rest for s in chain(stages, target) for w, rest in s.lines if w == "RUN")
    assert "gcc" in runtime and "libc6-dev" in runtime
    check = last(stages, target, "HEALTHCHECK") or ""
    assert json.loads(check.partition(" CMD ")[2]) == ["worker", "--check"]
    assert (
        re.search(r"--start-period=(\d+)s", check)
        and int(re.findall(r"--start-period=(\d+)s", check)[0]) >= 300
    )


def test_worker_caches_live_in_the_images_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    _, stages = parse()
    env = {}
    for s in chain(stages, "cuda"):
        for word, rest in s.lines:
            if word == "ENV":
                env.update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    (volume,) = json.loads(last(stages, "cuda", "VOLUME") or "[]")
    assert env["HF_HOME"].startswith(volume + "/") and env["BATCHQ_CACHE_DIR"].startswith(volume + "/")
    monkeypatch.setenv("BATCHQ_CACHE_DIR", env["BATCHQ_CACHE_DIR"])
    assert cache_dir() == Path(env["BATCHQ_CACHE_DIR"])  # the variable batchq reads


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def keys_anywhere(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in keys_anywhere(v)}
    return {k for v in node for k in keys_anywhere(v)} if isinstance(node, list) else set()


def test_compose_builds_named_targets_of_the_dockerfile_never_an_inline_one() -> None:
    assert {"dockerfile_inline", "dockerfile"} & keys_anywhere(compose()) == set()
    _, stages = parse()
    built = {}
    for name, svc in compose()["services"].items():
        if "build" in svc:
            assert svc["build"]["context"] == "." and svc["build"]["target"] in stages, name
            built[name] = svc["build"]["target"]
    assert built == {"worker": "cuda", "worker-tp": "cuda", "worker-cpu": "cpu", "producer": "producer"}
    images = {compose()["services"][n]["image"]: t for n, t in built.items()}
    assert len(images) == len(set(built.values())), "one image name per target"


def test_compose_keeps_to_what_compose_v1_reads() -> None:
    spec = compose()
    # No `version`: v1 (>= 1.27) then reads the file as the Compose Specification, as v2 does.
    assert "version" not in spec
    assert {k for k in spec if not k.startswith("x-")} <= COMPOSE_V1_TOP
    for name, svc in spec["services"].items():
        assert set(svc) <= COMPOSE_V1_SERVICE, (name, set(svc) - COMPOSE_V1_SERVICE)
        assert set(svc.get("build", {})) <= COMPOSE_V1_BUILD, name
        assert set(svc.get("healthcheck", {})) <= COMPOSE_V1_HEALTHCHECK, name
        for device in svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []):
            assert set(device) <= COMPOSE_V1_GPU, name
        for dep in (svc.get("depends_on") or {}).values() if isinstance(svc.get("depends_on"), dict) else []:
            assert dep["condition"] in COMPOSE_V1_CONDITIONS, name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(("./", "${", "/")) or source in spec["volumes"], (name, source)


def test_compose_workers_keep_their_model_cache_and_stop_after_their_drain() -> None:
    _, stages = parse()
    (volume,) = json.loads(last(stages, "cuda", "VOLUME") or "[]")
    grace = WorkerConfig.model_fields["shutdown_grace_s"].default
    for name in ("worker", "worker-tp", "worker-cpu"):
        svc = compose()["services"][name]
        assert f"model-cache:{volume}" in svc["volumes"], name
        assert int(svc["stop_grace_period"].removesuffix("s")) >= grace + 30, name
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0"


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a folder above it decides."""
    verdict = False
    parts = path.split("/")
    for pattern in patterns:
        keep = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        rx = re.escape(body).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rx = rx.replace(".*/", "(.*/)?")
        if any(re.fullmatch(rx, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            verdict = not keep
    return verdict


def test_the_build_context_holds_what_the_images_copy_and_nothing_else() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    _, stages = parse()
    copied = [rest.split()[:-1] for w, rest in stages["source"].lines if w == "COPY"]
    for path in [p for group in copied for p in group]:
        assert not ignored(path, patterns), path
    for path in (
        "worker/kernels/linear.c",
        "producer/wire/lua/claim_jobs.lua",
        "producer/api/console/app.js",
    ):
        assert not ignored(path, patterns), path
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "worker/__pycache__/cli.cpython-311.pyc",
                 "benchmarks/bench.py", "results.jsonl", "deploy/k8s/base/kustomization.yaml"):  # fmt: skip
        assert ignored(path, patterns), path
