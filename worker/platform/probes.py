"""Measurements of this machine that decide kernel and dtype choices, each made by the first worker to
start here and kept for every later one (`kept`): the bf16-over-float32 GEMM speedup, and linear.c's tuning
record."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from worker.cache_dir import cache_dir
from worker.engine_config import CpuKernels

if TYPE_CHECKING:
    from worker.kernels.native_linear import LinearTuning

log = logging.getLogger(__name__)

# auto on CPU takes bfloat16 only where its matmuls are clearly faster than float32 (bf16 matrix units, or
# bf16 dot products at full vector width): on CPUs that merely convert bf16 its GEMMs are slower and float32
# is exact.
# float32's rate is the better of torch's matmul and linear.c's (the path float32 runs on the CPU).
BF16_MIN_SPEEDUP = 1.3


def gemm_flops(dtype: torch.dtype, n: int = 1024, reps: int = 4) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on the CPU (one warm-up, best of `reps`)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def native_gemm_flops(n: int = 1024, reps: int = 4, tuning: LinearTuning | None = None) -> float:
    """FLOP/s of linear.c on an n x n x n product under `tuning` (None: the default; 0 where linear.c is not
    available)."""
    from worker.kernels import native_linear

    if native_linear.library() is None:
        return 0.0
    tuning = tuning or native_linear.DEFAULT_TUNING
    a, w = torch.randn(n, n), native_linear.pack(torch.randn(n, n))
    native_linear.linear(a, w, None, None, n, tuning)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        native_linear.linear(a, w, None, None, n, tuning)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure_bf16_gemm_speedup(cpu_kernels: CpuKernels, linear_tuning: LinearTuning | None = None) -> float:
    """bf16 GEMM FLOP/s over float32's on this CPU, measured now (float32's: the better of torch's and, with
    cpu_kernels auto, linear.c's under linear_tuning); 0 without oneDNN."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return 0.0
    f32 = gemm_flops(torch.float32)
    if cpu_kernels == "auto":
        f32 = max(f32, native_gemm_flops(tuning=linear_tuning))
    bf16 = gemm_flops(torch.bfloat16)
    log.info("CPU matmul %.0f GFLOP/s float32, %.0f bfloat16", f32 / 1e9, bf16 / 1e9)
    return bf16 / f32


def _cpu_model() -> str:
    try:
        return next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def _probe_path(name: str, cpu_kernels: CpuKernels) -> Path:
    """The file that keeps this machine's measurement `name`: one per CPU model and flags, torch build, thread
    count, kernel ISA, linear.c's code (every probe times it, or chooses by it) and cpu_kernels setting (what
    the rates depend on)."""
    from worker.kernels.native_build import cpu_features, cpu_isa, sources_text
    from worker.kernels.native_linear import SOURCES

    what = "\0".join(
        [
            _cpu_model(),
            cpu_features(),
            cpu_isa(),
            torch.__version__,
            str(torch.get_num_threads()),
            cpu_kernels,
            sources_text(SOURCES),
        ]
    )
    return cache_dir() / "probes" / f"{name}-{hashlib.sha256(what.encode()).hexdigest()[:16]}.json"


def kept(
    name: str, what: str, cpu_kernels: CpuKernels, measure: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The record `measure` gives on this machine, measured by the first worker to start here and kept in
    the cache directory for every later one (under a lock, so workers starting together share it). A kept
    record that does not read back as one `measure` gives (another version's) is measured again.

    Timings decide kernel choices, and so the answers and the result cache's fingerprint: measured at every
    start, a worker that starts while another process loads the cores can choose otherwise than its
    neighbours, and the fleet then answers the same request two ways. Kept, the choice is the machine's.
    Delete the file (the log names it) to measure again.
    """
    path = _probe_path(name, cpu_kernels)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a read-only cache: measure, as every start would
        log.warning("cannot keep the %s probe in %s (%s): measured at each start", what, path.parent, exc)
        return measure()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # workers starting together: one measures, the rest read its record
        try:
            record = orjson.loads(path.read_bytes())["record"]
            if isinstance(record, dict):
                log.info("%s: %s, measured on this machine earlier (%s)", what, _shown(record), path)
                return record
        except (OSError, ValueError, KeyError, TypeError):
            pass
        record = measure()
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_bytes(orjson.dumps({"record": record, "measured_at": time.time()}))
        os.replace(tmp, path)
        log.info("%s: %s measured, kept for later starts in %s", what, _shown(record), path)
        return record
    finally:
        os.close(lock)  # closing releases the lock


def _shown(record: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items())


def cpu_bf16_gemm_speedup(cpu_kernels: CpuKernels, linear_tuning: LinearTuning | None = None) -> float:
    """This machine's bf16-over-float32 GEMM speedup (measure_bf16_gemm_speedup), kept (`kept`)."""
    record = kept(
        "bf16-speedup",
        "bf16 GEMM speedup over float32",
        cpu_kernels,
        lambda: {"speedup": measure_bf16_gemm_speedup(cpu_kernels, linear_tuning)},
    )
    try:
        return float(record["speedup"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"the kept bf16 probe {record} has no speedup: delete it to measure again") from None


def kept_linear_tuning() -> LinearTuning:
    """linear.c's tuning for this machine (native_linear.measure_tuning: its prefetch hint, then under it
    whether decode steps also prefetch far ahead into L2, take whole-panel tiles at 1-3 rows, and run paced
    below a tile's rows; which is faster differs between CPUs), measured once and kept as one record (the
    knobs and the speedups that chose them). Made before any probe that times linear.c, which times it under
    this tuning. The answers never depend on it, only the speed; DEFAULT_TUNING where linear.c cannot be
    built."""
    from worker.kernels import native_linear

    if native_linear.library() is None:
        return native_linear.DEFAULT_TUNING

    def measure() -> dict[str, Any]:
        tuning, speedups = native_linear.measure_tuning()
        return {**tuning.as_dict(), "speedups": speedups}

    record = kept("linear-tuning", "linear.c's tuning", "auto", measure)
    try:
        return native_linear.LinearTuning.from_dict({k: v for k, v in record.items() if k != "speedups"})
    except (ValueError, TypeError):
        raise ValueError(
            f"the kept linear.c tuning {record} does not read: delete it to measure again"
        ) from None
