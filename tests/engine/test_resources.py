"""Start-up decisions: the CPU dtype that `auto` picks."""

from __future__ import annotations

import pytest
import torch

from worker.engine import resources
from worker.engine.resources import pick_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("f32", "bf16", "want"),
    [
        (100e9, 240e9, torch.bfloat16),  # AMX / Zen 4: bf16 GEMMs 2.4x faster
        (225e9, 149e9, torch.float32),  # AVX512-BF16 without AMX: bf16 slower
        (100e9, 125e9, torch.float32),  # a small gain does not pay for the lost precision
    ],
)
def test_auto_takes_bfloat16_on_cpu_only_where_its_matmuls_are_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, f32: float, bf16: float, want: torch.dtype
) -> None:
    rates = {torch.float32: f32, torch.bfloat16: bf16}
    monkeypatch.setattr(resources, "gemm_flops", lambda dtype, **_: rates[dtype])
    assert pick_dtype("auto", CPU) == want
    assert pick_dtype("float32", CPU) == torch.float32 and pick_dtype("bfloat16", CPU) == torch.bfloat16


def test_gemm_probe_measures_this_machine() -> None:
    # The real probe, small: both dtypes run and give a plausible rate (above 1 GFLOP/s, below 100 TFLOP/s).
    for dtype in (torch.float32, torch.bfloat16):
        assert 1e9 < resources.gemm_flops(dtype, n=256, reps=2) < 1e14
