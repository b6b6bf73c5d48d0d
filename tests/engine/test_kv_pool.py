"""KV pool sizing: on a CPU what the configured concurrency can use, within what kv_watermark leaves;
on CUDA what kv_watermark leaves. kv_cache_gb, when set, is the size, within the same watermark."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from worker.engine import kv_pool
from worker.engine.engine import Engine
from worker.engine.kv_pool import concurrency_blocks, kv_bytes_per_token, size_kv_pool
from worker.engine_config import EngineConfig
from worker.models.loader import LoadedModel, load_model

CPU = torch.device("cpu")
CONTEXT = 256  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def loaded(ckpt: Path) -> LoadedModel:
    return load_model(str(ckpt), torch.float32, CPU)


def cfg(ckpt: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=str(ckpt), device="cpu", dtype="float32", **kw)  # type: ignore[arg-type]


def block_bytes(loaded: LoadedModel, block_size: int) -> int:
    return kv_bytes_per_token(loaded.model, torch.float32) * block_size


def available(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Pretend the machine has `nbytes` available and a step needs no working memory."""
    monkeypatch.setattr(kv_pool.psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes))
    monkeypatch.setattr(kv_pool, "_cpu_step_bytes", lambda *_: 0)


def test_concurrency_blocks_is_one_spare_sequence_beyond_max_num_seqs_each_rounded_to_blocks() -> None:
    assert concurrency_blocks(max_num_seqs=4, max_model_len=100, block_size=16) == (4 + 1) * 7
    assert concurrency_blocks(max_num_seqs=1, max_model_len=32, block_size=16) == 2 * 2
    assert concurrency_blocks(max_num_seqs=64, max_model_len=8192, block_size=16) == 65 * 512


@pytest.mark.parametrize(
    ("max_num_seqs", "max_model_len", "want"),
    [
        (3, 100, (3 + 1) * 13),  # max_model_len caps the model's 256
        (5, None, (5 + 1) * (CONTEXT // 8)),  # the model's own context
        (2, 4096, (2 + 1) * (CONTEXT // 8)),  # max_model_len above the model's context: the model's
    ],
)
def test_the_default_cpu_pool_is_what_the_configured_concurrency_can_use(
    ckpt: Path, caplog: pytest.LogCaptureFixture, max_num_seqs: int, max_model_len: int | None, want: int
) -> None:
    settings = cfg(ckpt, block_size=8, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    with caplog.at_level(logging.INFO, logger="worker.engine.kv_pool"):
        engine = Engine.load(settings)
    assert engine.block_manager.num_blocks == want
    context = min(CONTEXT, max_model_len or CONTEXT)
    assert engine.block_manager.num_blocks == concurrency_blocks(max_num_seqs, context, 8)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:"))
    assert f"KV pool: {want:,} blocks (" in line
    assert (
        f"= (max_num_seqs {max_num_seqs} + 1) x max_model_len {context} tokens; kv_watermark would allow"
        in line
    )


def test_kv_cache_gb_sets_the_cpu_pool_below_or_above_the_concurrency_default(
    loaded: LoadedModel, ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bb = block_bytes(loaded, 16)
    need = concurrency_blocks(4, CONTEXT, 16)
    small = size_kv_pool(
        cfg(ckpt, max_num_seqs=4, kv_cache_gb=10 * bb / 1024**3), loaded.model, torch.float32, CPU
    )
    assert small == 10
    with caplog.at_level(logging.INFO, logger="worker.engine.kv_pool"):
        big = size_kv_pool(cfg(ckpt, max_num_seqs=4, kv_cache_gb=3 * need * bb / 1024**3), loaded.model,
                           torch.float32, CPU)  # fmt: skip
    # Set on purpose, it is the size: the blocks beyond the concurrency's serve the prefix cache.
    assert big == 3 * need
    assert f"use {need:,} blocks; the rest serves the prefix cache only" in caplog.text


def test_the_watermark_caps_the_cpu_pool_default_or_set(
    loaded: LoadedModel, ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bb = block_bytes(loaded, 16)
    need = concurrency_blocks(64, CONTEXT, 16)
    available(monkeypatch, 100 * bb)  # kv_watermark 0.5 leaves 50 blocks, fewer than the 64 + 1 sequences
    with caplog.at_level(logging.INFO, logger="worker.engine.kv_pool"):
        assert size_kv_pool(cfg(ckpt, kv_watermark=0.5), loaded.model, torch.float32, CPU) == 50
    assert "= what kv_watermark 0.5 leaves (" in caplog.text
    assert f"(max_num_seqs 64 + 1) x max_model_len 256 tokens would take {need:,} blocks" in caplog.text
    assert size_kv_pool(cfg(ckpt, kv_watermark=0.5, kv_cache_gb=80 * bb / 1024**3), loaded.model,
                        torch.float32, CPU) == 50  # fmt: skip
    available(monkeypatch, 100 * need * bb)  # plenty: the concurrency decides again
    assert size_kv_pool(cfg(ckpt), loaded.model, torch.float32, CPU) == need
    available(monkeypatch, bb // 2)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        size_kv_pool(cfg(ckpt), loaded.model, torch.float32, CPU)


def test_the_cuda_pool_still_fills_the_watermark(
    loaded: LoadedModel, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU needed: the device's memory figures are stubbed. max_num_seqs does not bound it.
    bb = block_bytes(loaded, 16)
    total, used = 10_000 * bb, 1_000 * bb
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (total - used, total))
    monkeypatch.setattr(kv_pool, "_peak_activation_bytes", lambda *_: 500 * bb)
    cuda = torch.device("cuda")
    settings = cfg(ckpt, max_num_seqs=1, max_model_len=16, kv_watermark=0.5)
    assert size_kv_pool(settings, loaded.model, torch.float32, cuda) == 5_000 - 1_000 - 500
    capped = settings.model_copy(update={"kv_cache_gb": 100 * bb / 1024**3})
    assert size_kv_pool(capped, loaded.model, torch.float32, cuda) == 100
