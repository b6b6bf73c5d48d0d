"""The machine the engine runs on, chosen once at load as vLLM's platforms are: a CPU (`cpu.CpuPlatform`) or
a CUDA device (`cuda.CudaPlatform`). A platform owns every setting and measurement of the machine: the
library caps, thread budget and co-tenant share, the heap settings, the dtype probes and their kept cache,
and linear.c's tuning record. It sits below the engine and above the kernels, whose choices it measures."""

from __future__ import annotations

from worker.engine_config import Device
from worker.platform.base import Platform, pick_device
from worker.platform.dtypes import Dtypes

__all__ = ["Dtypes", "Platform", "load_platform", "pick_device"]


def load_platform(device: Device) -> Platform:
    """The platform of the device named (auto: CUDA where it is available, else the CPU)."""
    chosen = pick_device(device)
    if chosen.type == "cpu":
        from worker.platform.cpu import CpuPlatform

        return CpuPlatform()
    from worker.platform.cuda import CudaPlatform

    return CudaPlatform(chosen)
