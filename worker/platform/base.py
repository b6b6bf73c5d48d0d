"""What every platform answers: the device, the settings made once before the model loads, the dtypes,
and the kernel choices that depend on the machine rather than on the model."""

from __future__ import annotations

import torch

from worker.engine_config import EngineConfig
from worker.kernels.native_linear import DEFAULT_TUNING, LinearTuning
from worker.platform.dtypes import Dtypes
from worker.platform.threads import CpuShare


class Platform:
    """One kind of machine the engine runs on, chosen once at load (`worker.platform.load_platform`).
    Engine.load asks it, in this order: `prepare` (before any matmul), `dtypes`, then, once the model is
    loaded, `after_load`, `fast_bf16_gemm` and `linear_tuning` for the backend, and `cpu_share` for the
    engine's thread count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # linear.c's tuning (the knobs that change its speed, never its answers)
        self.linear_tuning: LinearTuning = DEFAULT_TUNING

    def prepare(self, cfg: EngineConfig) -> None:
        """Process-wide settings, made before the first matmul and the dtype probes."""
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)

    def dtypes(self, cfg: EngineConfig) -> Dtypes:
        raise NotImplementedError

    def after_load(self) -> None:
        """Settings made once the weights are in place."""

    def fast_bf16_gemm(self, cfg: EngineConfig, weight_dtype: torch.dtype) -> bool:
        """Whether prompt-sized steps of bfloat16 weights should take torch's bf16 GEMM over linear.c."""
        return False

    def cpu_share(self, cfg: EngineConfig) -> CpuShare | None:
        """The co-tenant watch that moves the engine's thread count, where one applies."""
        return None

    def describe(self) -> str:
        """The device as the load log names it."""
        return str(self.device)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)
