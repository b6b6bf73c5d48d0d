"""Building and loading the C decode kernel: cached per machine, and every way it can be missing (or
switched off by cpu_kernels = "torch") leaves the torch path, with a warning instead of failing the worker."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.kernels.paged_cases import GRID, assert_close, build_cache, random_queries
from tests.kernels.test_cpu_attention import cpu_layout
from worker.engine_config import EngineConfig
from worker.kernels import native_attention, native_build, reference
from worker.kernels.backend import select_backend
from worker.kernels.torch_attention import TorchAttention


@pytest.fixture
def fresh_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every library() forgets its cached result and builds into an empty cache dir; restored afterwards."""
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    native_build.clear_caches()
    yield tmp_path / "native"
    native_build.clear_caches()


def _decode_is_right() -> None:
    case = GRID[2]
    gen = torch.Generator().manual_seed(5)
    cache = build_cache(case, [3, 70, 513], gen, torch.device("cpu"))
    q = random_queries(case, 3, gen, torch.device("cpu"))
    scale = 1 / math.sqrt(case.head_dim)
    got = TorchAttention(native=True).paged_decode_attention(
        q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), cache.block_tables, cache.context_lens, scale
    )
    want = reference.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
    )
    assert_close(got, want, case.dtype)


def test_built_once_then_reused(fresh_library: Path) -> None:
    if native_build.compiler() is None:
        pytest.skip("no C compiler here")
    assert native_attention.library() is not None
    (built,) = list(fresh_library.glob("paged_decode-*.so"))
    stamp = built.stat().st_mtime_ns
    native_build.clear_caches()  # a new process, as far as library() knows

    assert native_attention.library() is not None

    assert list(fresh_library.glob("*")) == [built]  # no second build, no temp file left behind
    assert built.stat().st_mtime_ns == stamp


def test_switched_off_by_the_cpu_kernels_setting(fresh_library: Path) -> None:
    backend = select_backend(EngineConfig(cpu_kernels="torch"), torch.device("cpu"), torch.float32)

    assert not backend.c_decode and backend.linear.name == "torch" and not backend.decode_stack
    assert backend.rmsnorm is None and backend.rotary_ is None
    assert not fresh_library.exists()  # nothing was built
    _decode_is_right()


def test_failing_compiler_falls_back_with_a_warning(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")  # exists on PATH, exits 1: a broken toolchain
    with caplog.at_level(logging.WARNING, logger="worker.kernels.native_build"):
        assert native_attention.library() is None

    assert "false failed on paged_decode.c" in caplog.text
    assert list(fresh_library.glob("*")) == []  # the failed build left nothing behind
    _decode_is_right()


def test_no_compiler_falls_back_with_a_warning(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(fresh_library.parent))  # no cc, gcc or clang here
    with caplog.at_level(logging.WARNING, logger="worker.kernels.native_build"):
        assert native_attention.library() is None

    assert "no C compiler" in caplog.text
    _decode_is_right()


def test_shares_torchs_openmp_runtime() -> None:
    """The kernel's threads must come from torch's OpenMP pool: a second libgomp.so.1 would start its
    own threads, which then fight torch's spinning ones for the cores. (Wheels that bundle a renamed
    copy, libgomp-<hash>.so, serve their own package only.)"""
    if native_attention.library() is None:
        pytest.skip(f"no C kernel here (compiler: {native_build.compiler()})")
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {Path(line.split()[-1]) for line in maps if "/libgomp.so" in line}
    assert {p.parent for p in runtimes} == {Path(torch.__file__).parent / "lib"}, runtimes


def test_batchq_cpu_isa_builds_the_avx2_kernels_anywhere_and_refuses_an_unknown_set(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.kernels import native_linear

    avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    sink = torch.zeros(1)
    # The FMA probe returns the floats one round covers: 12 vectors of the width the library was built for.
    assert (lib := native_linear.library()) is not None
    assert lib.batchq_fma_probe(10, 1, sink.data_ptr()) == 12 * (16 if avx512 else 8)
    monkeypatch.setenv("BATCHQ_CPU_ISA", "avx2")
    native_build.clear_caches()
    assert (lib := native_linear.library()) is not None
    assert lib.batchq_fma_probe(10, 1, sink.data_ptr()) == 12 * 8  # AVX2's 8-float vectors
    assert len(list(fresh_library.glob("linear-*.so"))) == 2  # a build of its own, beside the native one
    assert native_linear.fma_peak(1, seconds=0.02) > 1e9

    monkeypatch.setenv("BATCHQ_CPU_ISA", "avx3")
    native_build.clear_caches()
    with pytest.raises(ValueError, match="BATCHQ_CPU_ISA='avx3': expected one of native, avx2"):
        native_linear.library()
