"""The CPU platform: torch's GEMM libraries capped to the kernels' instruction set, the thread budget and the
co-tenant watch, the heap settings, the dtype auto picks (measured once per machine and kept), and
linear.c's tuning record."""

from __future__ import annotations

import logging

import torch

from worker.engine_config import CpuKernels, Dtype, EngineConfig
from worker.kernels import native_linear
from worker.kernels.native_linear import LinearTuning
from worker.platform.base import Platform
from worker.platform.cpu_settings import bound_onednn_caches, cap_libraries, keep_freed_memory
from worker.platform.dtypes import DTYPES, Dtypes
from worker.platform.probes import BF16_MIN_SPEEDUP, cpu_bf16_gemm_speedup, kept_linear_tuning
from worker.platform.threads import CpuShare, cpu_budget

log = logging.getLogger(__name__)


class CpuPlatform(Platform):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def prepare(self, cfg: EngineConfig) -> None:
        cap_libraries()  # BATCHQ_CPU_ISA=avx2: torch's GEMMs as an AVX2-only CPU's, before any matmul
        bound_onednn_caches()  # before the dtype probe's matmuls
        super().prepare(cfg)
        # a thread per core of the node would outrun the cgroup's quota; the ranks of a tensor-parallel group
        # share the budget
        budget = max(1, cpu_budget() // cfg.tensor_parallel_size)
        if cfg.num_threads is None and torch.get_num_threads() > budget:
            torch.set_num_threads(budget)
        if cfg.cpu_kernels == "auto":
            self.linear_tuning = kept_linear_tuning()  # before the dtype and GEMM probes, which time linear.c

    def dtypes(self, cfg: EngineConfig) -> Dtypes:
        requested = cpu_dtype(cfg.dtype, cfg.cpu_kernels, cfg.batch_invariant, self.linear_tuning)
        c_kernels = cfg.cpu_kernels == "auto" and native_linear.library() is not None
        compute, storage = invariant_cpu_storage(requested, cfg.batch_invariant, c_kernels)
        return Dtypes(requested, compute, storage)

    def after_load(self) -> None:
        keep_freed_memory()  # after loading, so what the load freed (staging buffers) went back to the OS

    def fast_bf16_gemm(self, cfg: EngineConfig, weight_dtype: torch.dtype) -> bool:
        # asked only where it could apply: the probe takes seconds, and under batch invariance no kernel is
        # chosen by a step's row count
        if cfg.batch_invariant or cfg.cpu_kernels != "auto" or weight_dtype != torch.bfloat16:
            return False
        return cpu_bf16_gemm_speedup(cfg.cpu_kernels, self.linear_tuning) >= BF16_MIN_SPEEDUP

    def cpu_share(self, cfg: EngineConfig) -> CpuShare | None:
        # An explicit num_threads is the operator's; otherwise the thread count follows the cores other
        # processes leave free.
        # (not for a tensor-parallel group's rank 0, whose ranks would then run different thread counts)
        alone = cfg.num_threads is None and cfg.tensor_parallel_size == 1
        return CpuShare(torch.get_num_threads()) if alone else None

    def describe(self) -> str:
        return f"cpu ({torch.get_num_threads()} threads)"


def cpu_auto_dtype(cpu_kernels: CpuKernels, linear_tuning: LinearTuning | None = None) -> torch.dtype:
    """bfloat16 when its GEMMs run BF16_MIN_SPEEDUP x faster than float32's here (linear.c timed under
    linear_tuning), else float32."""
    speedup = cpu_bf16_gemm_speedup(cpu_kernels, linear_tuning)
    choice = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    log.info("dtype auto -> %s (bf16 GEMMs %.2fx float32's)", str(choice).removeprefix("torch."), speedup)
    return choice


def cpu_dtype(
    name: Dtype, cpu_kernels: CpuKernels, invariant: bool = False, linear_tuning: LinearTuning | None = None
) -> torch.dtype:
    """The dtype asked, or auto's choice on a CPU: under batch invariance bfloat16 where linear_bf16dot.c
    multiplies in bfloat16 (AVX-512 BF16), else float32; without it the faster of float32 and bfloat16
    (cpu_auto_dtype)."""
    if name != "auto":
        return DTYPES[name]
    if invariant:
        # torch's bfloat16 speed on a CPU is oneDNN's GEMM, which picks its kernel by the step's row count.
        # linear_bf16dot.c's products sum a row the same way at every row count, at twice float32's
        # multiply rate; without AVX-512 BF16 the C kernels' float32 is the invariant choice.
        if cpu_kernels == "auto" and native_linear.has_bf16dot():
            log.info("dtype auto -> bfloat16 (batch_invariant: bfloat16 products in linear.c at every row "
                     "count, AVX-512 BF16)")  # fmt: skip
            return torch.bfloat16
        log.info("dtype auto -> float32 (batch_invariant: no bf16 GEMM here sums a row the same at every "
                 "row count; batch_invariant = false lets oneDNN's in where it is faster)")  # fmt: skip
        return torch.float32
    return cpu_auto_dtype(cpu_kernels, linear_tuning)


def invariant_cpu_storage(
    dtype: torch.dtype, invariant: bool, c_kernels: bool
) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, narrow storage or None). A CPU engine under batch invariance asked for bfloat16 or
    float16 keeps what it stores narrow (the weights where linear.c reads them: bfloat16; the KV cache)
    and computes in float32 in the C kernels, whose sum for a row is the same at every row count; torch's
    bf16 ops pick kernels by the step's size. Without the C kernels nothing is invariant on a CPU: the
    dtype stays, with a warning."""
    if not invariant or dtype == torch.float32:
        return dtype, None
    name = str(dtype).removeprefix("torch.")
    if not c_kernels:
        log.warning("batch_invariant: %s on this CPU runs torch's ops (no C kernels here), whose GEMMs pick "
                    "kernels by the step's rows: outputs may depend on the batch", name)  # fmt: skip
        return dtype, None
    weights = "bfloat16 weights" if dtype == torch.bfloat16 else "float32 weights (linear.c reads no float16)"
    products = (
        "bfloat16 products in the linear layers (AVX-512 BF16), float32 elsewhere"
        if dtype == torch.bfloat16 and native_linear.has_bf16dot()
        else "float32 arithmetic"
    )
    log.info("dtype %s on the CPU, batch-invariant: %s and a %s KV cache, %s in the C kernels "
             "(batch_invariant = false computes in %s through torch)", name, weights, name, products, name)  # fmt: skip
    return torch.float32, dtype
