"""The linear layers on the CPU: linear.c runs them under float32 compute, and `weight_dtype` stores them
narrower (bfloat16, int8) with outputs close to float32's, refused where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig
from worker.kernels import native_linear

pytestmark = pytest.mark.skipif(native_linear.library() is None, reason="no C compiler here")

PROMPTS = [list(range(10, 47)), [7, 8, 9, 10, 11], [300, 5] * 20]


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Tied embeddings: the LM head's narrow rows are also the token embeddings.
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tied"), "llama", tie_word_embeddings=True)


def load(path: Path, weight_dtype: str = "auto") -> Engine:
    cfg = EngineConfig(
        dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, weight_dtype=weight_dtype
    )
    return Engine.load(cfg)  # type: ignore[arg-type]


def prefill_logits(engine: Engine) -> torch.Tensor:
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"p{i}", GenerationParams(max_new_tokens=1), prompt_token_ids=p))
    engine._intake()
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.phase == "prefill"
    return engine.model_runner.compute_logits(batch)


def test_float32_engine_runs_every_linear_through_the_kernel(tied_llama: Path) -> None:
    engine = load(tied_llama)
    model = engine.model_runner.model
    assert engine.model_runner.backend.linear.name == "c"
    assert all(lin.method.name == "c" and lin.weight.dtype == torch.float32 for lin in model.linears())


@pytest.mark.parametrize(
    ("weight_dtype", "dtype", "rel"), [("bfloat16", torch.bfloat16, 0.02), ("int8", torch.int8, 0.05)]
)
def test_narrow_weights_stay_close_to_float32(
    tied_llama: Path, weight_dtype: str, dtype: torch.dtype, rel: float
) -> None:
    full = load(tied_llama)
    narrow = load(tied_llama, weight_dtype)
    model = narrow.model_runner.model
    assert all(lin.weight.dtype == dtype for lin in model.linears())
    assert model.dtype == torch.float32  # activations, norms and the KV cache stay float32

    want, got = prefill_logits(full), prefill_logits(narrow)

    err = (got - want).abs().max() / want.abs().max()
    assert 0 < float(err) < rel, f"{weight_dtype}: logits off by {float(err):.3g} of their range"
    assert narrow.fingerprint != full.fingerprint  # results cached under float32 never answer for it


@pytest.mark.parametrize(("weight_dtype", "dtype"), [("int8", "bfloat16"), ("bfloat16", "float16")])
def test_narrow_weights_refused_off_float32_cpu(tied_llama: Path, weight_dtype: str, dtype: str) -> None:
    # batch_invariant off: bfloat16 / float16 compute in torch's ops, which read no narrower weights
    cfg = EngineConfig(
        dtype=dtype,
        model=str(tied_llama),
        kv_cache_gb=0.01,
        weight_dtype=weight_dtype,
        batch_invariant=False,  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match=f"weight_dtype {weight_dtype} needs a CPU with float32 compute"):
        Engine.load(cfg)
    # batch-invariant (the default), a CPU's narrow dtype computes in float32: the weights take it
    engine = Engine.load(cfg.model_copy(update={"batch_invariant": True}))
    assert engine.model_runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    assert {lin.weight.dtype for lin in engine.model_runner.model.linears()} == {getattr(torch, weight_dtype)}


def test_weight_dtype_of_the_compute_dtype_changes_nothing(tied_llama: Path) -> None:
    engine = Engine.load(
        EngineConfig(dtype="bfloat16", model=str(tied_llama), kv_cache_gb=0.01, weight_dtype="bfloat16")
    )
    assert all(
        lin.weight.dtype == torch.bfloat16 and lin.scale is None
        for lin in engine.model_runner.model.linears()
    )


def test_narrow_weights_refused_without_the_c_kernels(tied_llama: Path) -> None:
    cfg = EngineConfig(
        dtype="float32", model=str(tied_llama), kv_cache_gb=0.01, weight_dtype="int8", cpu_kernels="torch"
    )
    with pytest.raises(
        ValueError, match="needs the C linear kernel, unavailable here \\(cpu_kernels = 'torch'\\)"
    ):
        Engine.load(cfg)
