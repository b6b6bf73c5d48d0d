"""Process-wide settings of the libraries under torch and of the heap, made once on a CPU before the model
loads: torch's GEMM libraries capped to the kernels' instruction set, oneDNN's kernel caches bounded, and
glibc's malloc told to keep freed memory and to use one arena. Each says why (the runs behind them are in
benchmarks/RESULTS.md)."""

from __future__ import annotations

import ctypes
import os

from worker.kernels.native_build import cpu_isa

# What an AVX2-only CPU's copies of torch's own GEMM libraries would run, for BATCHQ_CPU_ISA=avx2: oneDNN
# (bfloat16 matmuls: on a CPU without AVX-512 bf16 they are far slower than float32, so the engine's bf16
# probe must not find AVX-512's) and MKL (float32 matmuls, which on Intel parts would otherwise keep
# AVX-512). Each library reads its setting once, at its first GEMM in the process (`cap_libraries`).
LIBRARY_CAPS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def cap_libraries() -> dict[str, str]:
    """Caps torch's oneDNN and MKL to the kernels' instruction set ($BATCHQ_CPU_ISA) where it is not native,
    so that a forced AVX2 run measures and chooses as an AVX2-only machine does. Call it before the
    process's first matmul; a setting already in the environment is the operator's and is kept. Returns
    the settings in force."""
    caps = LIBRARY_CAPS[cpu_isa()]
    for key, value in caps.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in caps}


# oneDNN, which runs bf16 matmuls on the CPU, JIT-compiles a kernel per matmul shape and keeps up to
# 1024 of them (its primitive cache, and ideep's LRU cache in front of it), each about a megabyte.
# Serving meets new shapes nearly every step (token counts, sequence counts, context lengths), so a
# worker's RSS grows by hundreds of MB over a run. 128 entries still hold a whole step's shapes, so every
# layer after the first reuses them (far fewer cost speed). oneDNN reads these once, at its first matmul
# in the process; a value already in the environment wins.
ONEDNN_CACHE_CAPACITY = 128


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's per-shape kernel caches. Only effective before the process's first bf16 matmul."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


# glibc hands every freed block above its mmap threshold back to the kernel, and trims the heap's top
# once 128 KB are free there. A CPU step's large temporaries (a long prefill's MLP activations, the
# logits) are then page-faulted in again, zero-filled, every time they are allocated: a visible share of
# a prefill step (benchmarks/profile_engine.py shows it). Keeping freed memory in the heap lets the next
# step reuse it; RSS holds at the step's high-water mark instead.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
KEEP_FREED_BYTES = 1 << 30


def keep_freed_memory(limit: int = KEEP_FREED_BYTES) -> bool:
    """Tell glibc's malloc to keep freed blocks of up to `limit` bytes for reuse. False off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # The mmap threshold first: setting either fixes both, and a trim threshold alone would leave the
    # mmap threshold at 128 KB, where every large block is mapped and faulted in afresh.
    if mallopt(M_MMAP_THRESHOLD, limit) != 1:
        return False
    one_malloc_arena()
    return bool(mallopt(M_TRIM_THRESHOLD, limit) == 1)


def one_malloc_arena() -> bool:
    """glibc's malloc: one arena for every thread that has not allocated yet (the device thread of async
    scheduling, AsyncEngine's step thread). Another thread's arena grows in heaps of at most 64 MB, so a
    larger block (a big step's logits) is mapped, faulted in and unmapped at every step whatever the
    thresholds. False off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_ARENA_MAX, 1) == 1)
