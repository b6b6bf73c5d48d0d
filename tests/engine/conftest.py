"""The real SmolLM2-135M-Instruct engine and its HF twin, loaded once per test session."""

from __future__ import annotations

import time

import pytest
import torch

from worker.engine.engine import Engine
from worker.engine_config import EngineConfig


@pytest.fixture(scope="session")
def smol_engine() -> Engine:
    t0 = time.monotonic()
    engine = Engine.load(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_gb=0.5))
    print(f"SmolLM2 engine loaded in {time.monotonic() - t0:.1f}s")
    return engine


@pytest.fixture(scope="session")
def smol_hf(smol_engine: Engine):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from worker.models.resolve import hf_checkpoint

    return AutoModelForCausalLM.from_pretrained(hf_checkpoint("smollm2-135m"), dtype=torch.float32).eval()
