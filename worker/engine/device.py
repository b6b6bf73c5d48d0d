"""Which device and dtype the engine runs on, decided once at start-up."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import torch

from worker.cache_dir import cache_dir
from worker.engine.config import CpuKernels, Device, Dtype, KVCacheDtype, WeightDtype

if TYPE_CHECKING:
    from worker.kernels.native_linear import LinearTuning

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: Device) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


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
    """FLOP/s of linear.c on an n x n x n product under `tuning` (None: the default; 0 where it is not
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


_T = TypeVar("_T")


def _kept(name: str, what: str, cpu_kernels: CpuKernels, measure: Callable[[], float]) -> float:
    """The figure `measure` gives on this machine, kept (`_kept_value`)."""
    return _kept_value(name, what, cpu_kernels, measure, float)


def _kept_value(
    name: str, what: str, cpu_kernels: CpuKernels, measure: Callable[[], Any], read: Callable[[Any], _T]
) -> _T:
    """What `measure` gives on this machine (a JSON value; `read` makes it the answer, and refuses a kept one
    it cannot read with ValueError, KeyError or TypeError), measured by the first worker to start here and
    kept in the cache directory for every later one (under a lock, so workers starting together share it).

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
        return read(measure())

    def shown(value: Any) -> str:
        return f"{value:.2f}x" if isinstance(value, float) else str(value)

    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # workers starting together: one measures, the rest read its figure
        try:
            value = orjson.loads(path.read_bytes())["value"]
            answer = read(value)
            log.info("%s %s, measured on this machine earlier (%s)", what, shown(value), path)
            return answer
        except (OSError, ValueError, KeyError, TypeError):
            pass
        value = measure()
        answer = read(value)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_bytes(orjson.dumps({"value": value, "measured_at": time.time()}))
        os.replace(tmp, path)
        log.info("%s %s measured, kept for later starts in %s", what, shown(value), path)
        return answer
    finally:
        os.close(lock)  # closing releases the lock


def cpu_bf16_gemm_speedup(cpu_kernels: CpuKernels, linear_tuning: LinearTuning | None = None) -> float:
    """This machine's bf16-over-float32 GEMM speedup (measure_bf16_gemm_speedup), kept (`_kept`)."""
    return _kept(
        "bf16-speedup",
        "bf16 GEMM speedup",
        cpu_kernels,
        lambda: measure_bf16_gemm_speedup(cpu_kernels, linear_tuning),
    )


def tune_cpu_linear() -> LinearTuning:
    """linear.c's tuning for this machine (native_linear.measure_tuning), measured once and kept (`_kept_value`:
    the four knobs, and the speedups that chose them): its prefetch hint (non-temporal prefetches stream
    the weights far slower on some CPUs and are best on others), then, under that hint, whether decode steps
    also prefetch far ahead into L2, whether decode steps of 1-3 rows take whole-panel tiles and whether
    decode steps of fewer rows than a tile holds run paced (AVX2 builds: which is faster differs between
    CPUs). Made before any probe that times linear.c, which times it under this tuning. Results do not
    depend on it."""
    from worker.kernels import native_linear

    if native_linear.library() is None:
        return native_linear.DEFAULT_TUNING

    def measure() -> dict[str, dict[str, Any]]:
        tuning, speedups = native_linear.measure_tuning()
        return {"tuning": tuning.as_dict(), "speedups": speedups}

    return _kept_value(
        "linear-tuning",
        "linear.c's tuning (each knob's speedup on over off)",
        "auto",
        measure,
        lambda kept: native_linear.LinearTuning.from_dict(kept["tuning"]),
    )


def cpu_auto_dtype(cpu_kernels: CpuKernels, linear_tuning: LinearTuning | None = None) -> torch.dtype:
    """bfloat16 when its GEMMs run BF16_MIN_SPEEDUP x faster than float32's here, else float32."""
    speedup = cpu_bf16_gemm_speedup(cpu_kernels, linear_tuning)
    choice = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
    log.info("dtype auto -> %s (bf16 GEMMs %.2fx float32's)", str(choice).removeprefix("torch."), speedup)
    return choice


def pick_dtype(
    name: Dtype,
    device: torch.device,
    cpu_kernels: CpuKernels,
    invariant: bool = False,
    linear_tuning: LinearTuning | None = None,
) -> torch.dtype:
    """auto: bfloat16 on CUDA; on CPU under batch invariance bfloat16 where linear_bf16dot.c multiplies in
    bfloat16 (AVX-512 BF16), else float32; without it the faster of float32 and bfloat16 (cpu_auto_dtype)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if invariant:
        # torch's bfloat16 speed on a CPU is oneDNN's GEMM, which picks its kernel by the step's row count.
        # linear_bf16dot.c's products sum a row the same way at every row count, at twice float32's
        # multiply rate; without AVX-512 BF16 the C kernels' float32 is the invariant choice.
        from worker.kernels import native_linear

        if cpu_kernels == "auto" and native_linear.has_bf16dot():
            log.info("dtype auto -> bfloat16 (batch_invariant: bfloat16 products in linear.c at every row "
                     "count, AVX-512 BF16)")  # fmt: skip
            return torch.bfloat16
        log.info("dtype auto -> float32 (batch_invariant: no bf16 GEMM here sums a row the same at every "
                 "row count; batch_invariant = false lets oneDNN's in where it is faster)")  # fmt: skip
        return torch.float32
    return cpu_auto_dtype(cpu_kernels, linear_tuning)


def invariant_cpu_storage(
    dtype: torch.dtype, device: torch.device, invariant: bool, c_kernels: bool
) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, narrow storage or None). A CPU engine under batch invariance asked for bfloat16 or
    float16 keeps what it stores narrow (the weights where linear.c reads them: bfloat16; the KV cache)
    and computes in float32 in the C kernels, whose sum for a row is the same at every row count; torch's
    bf16 ops pick kernels by the step's size. Without the C kernels nothing is invariant on a CPU: the
    dtype stays, with a warning."""
    if not invariant or device.type != "cpu" or dtype == torch.float32:
        return dtype, None
    name = str(dtype).removeprefix("torch.")
    if not c_kernels:
        log.warning("batch_invariant: %s on this CPU runs torch's ops (no C kernels here), whose GEMMs pick "
                    "kernels by the step's rows: outputs may depend on the batch", name)  # fmt: skip
        return dtype, None
    weights = "bfloat16 weights" if dtype == torch.bfloat16 else "float32 weights (linear.c reads no float16)"
    from worker.kernels import native_linear

    products = (
        "bfloat16 products in the linear layers (AVX-512 BF16), float32 elsewhere"
        if dtype == torch.bfloat16 and native_linear.has_bf16dot()
        else "float32 arithmetic"
    )
    log.info("dtype %s on the CPU, batch-invariant: %s and a %s KV cache, %s in the C kernels "
             "(batch_invariant = false computes in %s through torch)", name, weights, name, products, name)  # fmt: skip
    return torch.float32, dtype


def pick_kv_dtype(name: KVCacheDtype, compute: torch.dtype) -> torch.dtype:
    """The KV pool's element type: auto = the compute dtype."""
    return compute if name == "auto" else {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn}[name]


def pick_weight_dtype(
    name: WeightDtype, compute: torch.dtype, device: torch.device, storage: torch.dtype | None = None
) -> torch.dtype:
    """The linear weights' storage: auto = the compute dtype, or the narrow storage of invariant_cpu_storage
    (bfloat16; float32 for float16). A narrower one (bfloat16, int8) only on a CPU with float32 compute,
    where the C linear kernel widens it as it reads."""
    auto = compute if storage is None else (storage if storage == torch.bfloat16 else torch.float32)
    want = auto if name == "auto" else {**_DTYPES, "int8": torch.int8}[name]
    if want != compute and (device.type != "cpu" or compute != torch.float32):
        raise ValueError(
            f"weight_dtype {name} needs a CPU with float32 compute (dtype = 'float32'); this engine computes "
            f"in {str(compute).removeprefix('torch.')} on {device.type}: use weight_dtype = 'auto'"
        )
    return want
