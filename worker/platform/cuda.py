"""The CUDA platform: bfloat16 unless asked otherwise; its kernels (Triton, cuBLAS) need no settings or
probes of the machine."""

from __future__ import annotations

import torch

from worker.engine_config import EngineConfig
from worker.platform.base import Platform
from worker.platform.dtypes import DTYPES, Dtypes


class CudaPlatform(Platform):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)

    def dtypes(self, cfg: EngineConfig) -> Dtypes:
        dtype = torch.bfloat16 if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        return Dtypes(dtype, dtype)
