"""A mistyped model alias (issue 58): `worker --model smollm2-999m` is refused at once, naming the alias it
is near, instead of waiting out the hub's retries to suggest a download. Hub ids keep going to the hub.

The worker runs as the user runs it (a subprocess), online as far as huggingface_hub knows, with an empty
cache and the hub's address pointing at a closed port: nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.models.resolve import check_model_reference

DEAD_REDIS = "redis://127.0.0.1:1/0"  # never contacted: the model is refused first
HF_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
           "TRANSFORMERS_CACHE", "HF_ENDPOINT")  # fmt: skip


def run_worker(tmp_path: Path, model: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    hf_home = tmp_path / "hf-home"  # empty: nothing is cached
    hf_home.mkdir(exist_ok=True)
    clean |= {"HF_HOME": str(hf_home), "HF_ENDPOINT": "http://127.0.0.1:9", "HOME": str(tmp_path), **env}
    cmd = [sys.executable, "-m", "worker.cli", "--model", model, "--redis-url", DEAD_REDIS]
    return subprocess.run(
        cmd, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("model", ["smollm2-999m", "SmolLM2-135M", "smollm2-135"])
def test_a_mistyped_alias_is_refused_at_once_naming_the_alias(tmp_path: Path, model: str) -> None:
    start = time.monotonic()
    out = run_worker(tmp_path, model, timeout=20)
    took = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"worker: unknown model alias {model!r}: did you mean smollm2-135m?"]
    assert took < 15, f"took {took:.1f} s"


def test_a_slashless_name_far_from_every_alias_still_goes_to_the_hub(tmp_path: Path) -> None:
    out = run_worker(tmp_path, "gpt2", timeout=60, HF_HUB_OFFLINE="1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("worker: model 'gpt2': not in the local Hugging Face cache"), out.stderr


def test_an_org_name_hub_id_is_never_taken_for_an_alias(tmp_path: Path) -> None:
    out = run_worker(tmp_path, "someorg/smollm2-135m", timeout=60, HF_HUB_OFFLINE="1")
    assert out.returncode == 2, out.stderr
    assert "unknown model alias" not in out.stderr
    assert out.stderr.startswith("worker: model 'someorg/smollm2-135m': not in the local Hugging Face cache")


def test_a_hub_id_near_an_alias_but_cached_here_is_a_hub_id(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    snapshot = tmp_path / "models--smollm2-360m" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    check_model_reference("smollm2-360m")  # found in the cache: no alias refusal
