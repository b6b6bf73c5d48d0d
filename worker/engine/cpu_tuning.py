"""CPU allocator and oneDNN settings the engine makes once at load, each with its reason (the runs that
measured them: benchmarks/RESULTS.md, 2026-11-30)."""

from __future__ import annotations

import ctypes
import os

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
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
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
    return bool(mallopt(M_TRIM_THRESHOLD, limit) == 1)
