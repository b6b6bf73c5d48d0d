"""Building and loading the CPU kernels in C: compiled on first use for this machine, cached, bound by ctypes.

Building needs a C compiler (`$CC`, else cc, gcc or clang on PATH). Each library is cached under
$BATCHQ_CACHE_DIR/native, keyed by its sources, the compiler, its flags and this CPU's features, and
written atomically, so concurrent workers share one build. Without a compiler, or when the build fails,
`load` returns None with one warning, and the engine's backend keeps the torch paths
(worker/kernels/backend.py).

A library is bound with the ctypes signature of every function Python calls, declared once in the
module that calls it (`Signature`, checked against the C prototypes by tests/kernels/test_native_signatures.py):
a wrong argument type is not an exception but a corrupt stack. Only declared functions can be reached.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple, TypeVar

from worker.cache_dir import cache_dir

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent  # the .c sources and the headers they include
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",  # needs libgomp.so.1: torch's own copy is already loaded, so its thread pool is reused
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-shared",
    "-fPIC",
    "-lm",
]
X86_FLAGS = ["-mprefer-vector-width=512"]  # where AVX-512 exists, use all of it (ignored elsewhere)
# BATCHQ_CPU_ISA=avx2 builds the AVX2 variant of every kernel on a machine with AVX-512 (tuned for this
# CPU still), so that the path AVX2-only CPUs run can be tested and measured anywhere. Unset: native.
CPU_ISAS = {"native": [], "avx2": ["-march=x86-64-v3", "-mno-avx512f", "-mtune=native"]}


def cpu_isa() -> str:
    """The instruction set the kernels are built for: $BATCHQ_CPU_ISA, or native."""
    isa = os.environ.get("BATCHQ_CPU_ISA", "native") or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"BATCHQ_CPU_ISA={isa!r}: expected one of {', '.join(CPU_ISAS)}")
    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(
            f"BATCHQ_CPU_ISA={isa!r} is an x86 instruction set; this machine is {platform.machine()}"
        )
    return isa


class Signature(NamedTuple):
    """A C function's ctypes types: its return type (None: void) and its arguments, in order."""

    restype: Any
    argtypes: list[Any]


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def sources_text(sources: tuple[Path, ...]) -> str:
    """The text of `sources` and of every header beside them (what they #include): what a library's code,
    and so its speed, depends on."""
    headers = sorted(sources[0].parent.glob("*.h"))
    return "\0".join(f.read_text() for f in (*sources, *headers))


def build(cc: str, sources: tuple[Path, ...], extra_flags: tuple[str, ...] = ()) -> Path:
    """The library built from `sources` (linked into one library) for this machine, from the cache when
    it is there (extra_flags: e.g. a narrower -march, in tests)."""
    flags = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else []) + CPU_ISAS[cpu_isa()]
    flags += list(extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [sources_text(sources), cc, version, *flags, cpu_features()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"{sources[0].stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, *map(str, sources), "-o", tmp], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {sources[0].name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: another worker sees the whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU kernel %s: %s", sources[0].name, target)
    return target


def bind(path: Path, signatures: Mapping[str, Signature]) -> SimpleNamespace:
    """The library at `path`, as its declared functions only, each with its signature set."""
    lib = ctypes.CDLL(str(path))
    functions = {}
    for name, sig in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = sig.restype, sig.argtypes
        functions[name] = fn
    return SimpleNamespace(**functions)


def load(sources: tuple[Path, ...], what: str, signatures: Mapping[str, Signature]) -> SimpleNamespace | None:
    """Build (or find in the cache) and bind the library of `sources`; None, with one warning naming
    `what` runs on the torch path instead, where there is no compiler or the build fails."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (set CC or install gcc): %s runs on the slower torch path", what)
        return None
    try:
        return bind(build(cc, sources), signatures)
    except (OSError, RuntimeError) as exc:
        log.warning("CPU kernel for %s unavailable, using the torch path: %s", what, exc)
        return None


_F = TypeVar("_F", bound=Callable[[], SimpleNamespace | None])
_LOADERS: list[Any] = []


def cached(loader: _F) -> _F:
    """A library loader run once per process (`clear_caches` forgets every one)."""
    once = functools.cache(loader)
    _LOADERS.append(once)
    return once  # type: ignore[return-value]


def clear_caches() -> None:
    """Forget every loaded library, as a new process would (tests)."""
    for once in _LOADERS:
        once.cache_clear()
