"""Start-up decisions: the CPU dtype that `auto` picks, and the CPU allocator and oneDNN settings."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.kernels import native_build, native_linear
from worker.platform import cpu_settings, probes
from worker.platform.cpu import cpu_dtype, invariant_cpu_storage

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache directory of the test's own: no measurement kept from an earlier start answers for it."""
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("f32", "native", "bf16", "want"),
    [
        (100e9, 0.0, 240e9, torch.bfloat16),  # AMX / Zen 4: bf16 GEMMs 2.4x faster
        (225e9, 0.0, 149e9, torch.float32),  # AVX512-BF16 without AMX: bf16 slower
        (100e9, 0.0, 125e9, torch.float32),  # a small gain does not pay for the lost precision
        (200e9, 300e9, 300e9, torch.float32),  # linear.c outruns MKL: float32's rate is linear.c's
    ],
)
def test_auto_takes_bfloat16_on_cpu_only_where_its_matmuls_are_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, f32: float, native: float, bf16: float, want: torch.dtype
) -> None:
    rates = {torch.float32: f32, torch.bfloat16: bf16}
    monkeypatch.setattr(probes, "gemm_flops", lambda dtype, **_: rates[dtype])
    monkeypatch.setattr(probes, "native_gemm_flops", lambda **_: native)
    assert cpu_dtype("auto", "auto") == want
    assert cpu_dtype("float32", "auto") == torch.float32
    assert cpu_dtype("bfloat16", "auto") == torch.bfloat16


@pytest.mark.parametrize("bf16dot", [True, False])
def test_auto_under_batch_invariance_takes_bfloat16_only_where_linear_c_multiplies_it(
    monkeypatch: pytest.MonkeyPatch, bf16dot: bool
) -> None:
    # No probe of torch's GEMMs: oneDNN's bfloat16 picks kernels by row count, so only linear_bf16dot.c's
    # products (AVX-512 BF16) keep a bfloat16 engine invariant; elsewhere float32.
    monkeypatch.setattr(probes, "gemm_flops", lambda dtype, **_: pytest.fail("torch's GEMMs were probed"))
    monkeypatch.setattr(native_linear, "has_bf16dot", lambda: bf16dot)
    want = torch.bfloat16 if bf16dot else torch.float32
    assert cpu_dtype("auto", "auto", invariant=True) == want
    assert cpu_dtype("auto", "torch", invariant=True) == torch.float32
    assert cpu_dtype("float16", "auto", invariant=True) == torch.float16
    stored = invariant_cpu_storage(torch.bfloat16, invariant=True, c_kernels=True)
    assert stored == (torch.float32, torch.bfloat16)


def test_auto_without_the_c_kernels_weighs_torchs_float32_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # cpu_kernels = "torch": float32 runs on torch's matmul, so linear.c's rate (here the faster) is not asked.
    rates = {torch.float32: 200e9, torch.bfloat16: 300e9}
    monkeypatch.setattr(probes, "gemm_flops", lambda dtype, **_: rates[dtype])
    monkeypatch.setattr(probes, "native_gemm_flops", lambda **_: pytest.fail("linear.c was probed"))
    assert cpu_dtype("auto", "torch") == torch.bfloat16


def test_the_first_measurement_is_the_machines_choice_for_every_later_start(
    monkeypatch: pytest.MonkeyPatch, own_cache_dir: Path
) -> None:
    # A worker starting while the cores are loaded measures other rates; it must not pick the other dtype
    # (and answer, and key the result cache) unlike the workers that started before it.
    rates = {torch.float32: 100e9, torch.bfloat16: 240e9}
    monkeypatch.setattr(probes, "gemm_flops", lambda dtype, **_: rates[dtype])
    monkeypatch.setattr(probes, "native_gemm_flops", lambda **_: 0.0)
    assert cpu_dtype("auto", "auto") == torch.bfloat16
    rates[torch.bfloat16] = 90e9  # what a loaded machine would measure now
    assert cpu_dtype("auto", "auto") == torch.bfloat16
    assert cpu_dtype("auto", "torch") == torch.float32  # another setting, another measurement
    kept = list((own_cache_dir / "probes").glob("bf16-speedup-*.json"))
    assert len(kept) == 2
    for f in kept:  # deleted, the machine is measured again
        f.unlink()
    assert cpu_dtype("auto", "auto") == torch.float32


_PROBE = """
import sys, time, torch
from worker.platform import cpu, probes
rate = float(sys.argv[1])
def gemm_flops(dtype, **_):
    time.sleep(1.5)  # as long as a real probe of a big machine: the other process starts meanwhile
    return {torch.float32: 100e9, torch.bfloat16: rate}[dtype]
probes.gemm_flops = gemm_flops
probes.native_gemm_flops = lambda **_: 0.0
print(cpu.cpu_dtype("auto", "auto"))
"""


def test_workers_started_together_share_one_measurement(own_cache_dir: Path) -> None:
    # Two processes at once, one measuring bf16 fast and one slow: the lock lets one measure and the other
    # read its figure, so both take one dtype (which one depends on who came first).
    env = {**os.environ, "BATCHQ_CACHE_DIR": str(own_cache_dir)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _PROBE, rate], env=env, stdout=subprocess.PIPE, text=True)
        for rate in ("240e9", "90e9")
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and outs[0] in ("torch.bfloat16", "torch.float32")
    assert len(list((own_cache_dir / "probes").glob("bf16-speedup-*.json"))) == 1


def test_a_kept_figure_answers_only_for_the_linear_c_it_timed(
    monkeypatch: pytest.MonkeyPatch, own_cache_dir: Path
) -> None:
    # The probes time linear.c (or choose among its settings): a worker upgraded to another linear.c must
    # measure again, not keep the old code's figure for the new code's choices.
    rates = {"torch": 240e9, "c": 180e9}

    def kept() -> float:
        record = probes.kept(
            "a-probe", "a probe timing linear.c", "auto", lambda: {"x": rates["torch"] / rates["c"]}
        )
        return float(record["x"])

    assert kept() == pytest.approx(240 / 180)
    rates["c"] = 300e9  # the new kernel's rate
    assert kept() == pytest.approx(240 / 180)  # the same code: the kept figure
    text = native_build.sources_text(native_linear.SOURCES)
    monkeypatch.setattr(native_build, "sources_text", lambda sources: text + "/* a changed kernel */")
    assert kept() == pytest.approx(240 / 300)
    assert len(list((own_cache_dir / "probes").glob("a-probe-*.json"))) == 2


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_linear_c_tuning_is_measured_once_in_order_and_kept(
    monkeypatch: pytest.MonkeyPatch, own_cache_dir: Path
) -> None:
    # linear.c's prefetch hint, its far prefetch in decode steps, and in the AVX2 build (what AVX2-only
    # CPUs run) whole- or half-panel tiles for 1-3 rows and paced tiles for fewer rows than a tile holds,
    # are chosen by speed, each under the knobs chosen before it, and kept for every later start.
    monkeypatch.setenv("BATCHQ_CPU_ISA", "avx2")
    native_build.clear_caches()
    try:
        _, real = native_linear.measure_tuning(megabytes=8, rounds=1)
        assert set(real) == {"prefetch_t0", "far_prefetch", "wide_rows", "pace_rows"}
        # every knob ran on and off and was timed; how their rates compare is the machine's weather (a
        # co-tenant can take either setting's one round), not the code's
        assert all(math.isfinite(s) and s > 0 for s in real.values())
        speedup = {"prefetch_t0": 1.3, "far_prefetch": 1.1, "wide_rows": 1.25, "pace_rows": 1.2}
        timed: list[tuple[str, dict[str, int], tuple[int, ...]]] = []

        def fake_speedup(
            base: native_linear.LinearTuning, candidate: native_linear.LinearTuning, rows: tuple[int, ...],
            megabytes: int, rounds: int,
        ) -> float:  # fmt: skip
            knob = next(k for k, v in candidate.as_dict().items() if base.as_dict()[k] != v)
            timed.append((knob, base.as_dict(), rows))
            return speedup[knob]

        monkeypatch.setattr(native_linear, "_speedup", fake_speedup)
        everything = native_linear.LinearTuning(1, 1, native_linear.WIDE_ROWS, native_linear.PACE_ROWS)
        assert probes.kept_linear_tuning() == everything
        assert [knob for knob, _, _ in timed] == ["prefetch_t0", "far_prefetch", "wide_rows", "pace_rows"]
        assert timed[1][1]["prefetch_t0"] == 1  # the far prefetch measured under the hint chosen
        assert timed[3][2] == (5,)  # whole-panel tiles take 1-3 rows: pacing is measured where it applies
        # a later start, whose probes would measure otherwise, keeps the first start's tuning
        speedup.update(prefetch_t0=0.7, far_prefetch=0.9, wide_rows=0.8, pace_rows=0.8)
        assert probes.kept_linear_tuning() == everything
        assert len(timed) == 4  # kept: not measured again
        assert len(list((own_cache_dir / "probes").glob("linear-tuning-*.json"))) == 1  # one record
    finally:
        native_build.clear_caches()


def test_a_build_without_linear_c_keeps_the_default_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_linear, "library", lambda: None)
    assert native_linear.tunable() == frozenset()
    assert probes.kept_linear_tuning() == native_linear.DEFAULT_TUNING
    assert native_linear.measure_tuning() == (native_linear.DEFAULT_TUNING, {})


def test_gemm_probe_measures_this_machine() -> None:
    # The real probe, small: both dtypes run and give a rate. Below 100 TFLOP/s (a 2-core CPU's is far
    # less); above 10 MFLOP/s, which a busy machine's slowest pass still reaches (an idle one's is ~100x).
    for dtype in (torch.float32, torch.bfloat16):
        assert 1e7 < probes.gemm_flops(dtype, n=256, reps=2) < 1e14
    native = probes.native_gemm_flops(n=256, reps=4)  # one probe, the best of 4 passes
    assert native == 0 or 1e7 < native < 1e14


# Runs in a fresh interpreter: oneDNN reads its cache capacity once, at the process's first matmul.
_GROWTH = """
import random, sys, torch
from worker.platform.cpu_settings import bound_onednn_caches, keep_freed_memory
if sys.argv[1] == "bounded":
    bound_onednn_caches()
keep_freed_memory()
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
random.seed(0)
start = rss_mb()
for _ in range(600):  # as many distinct shapes as a few hundred serving steps meet
    n, t = random.randint(1, 32), random.randint(16, 600)
    torch.matmul(torch.ones(3, n, 3, 64, dtype=torch.bfloat16), torch.ones(3, n, 64, t, dtype=torch.bfloat16))
print(rss_mb() - start)
"""


def _fresh_interpreter(script: str, mode: str) -> str:
    """Run `script` with argv[1] = mode in a new interpreter (oneDNN's cache capacity unset) -> last word."""
    caps = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    env = {k: v for k, v in os.environ.items() if k not in caps}
    out = subprocess.run(
        [sys.executable, "-c", script, mode], env=env, capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout.split()[-1]


def _rss_growth_mb(mode: str) -> float:
    return float(_fresh_interpreter(_GROWTH, mode))


def test_bf16_matmul_kernel_caches_stay_bounded_under_ever_new_shapes() -> None:
    # Every new matmul shape costs oneDNN a JIT kernel kept in its caches; with the default capacity a
    # long-running worker's RSS grows by hundreds of MB. Bounded, 600 shapes stay well under 200 MB.
    unbounded = _rss_growth_mb("default")
    if unbounded < 300:
        pytest.skip(f"this CPU's bf16 matmuls keep no per-shape kernels ({unbounded:.0f} MB for 600 shapes)")
    bounded = _rss_growth_mb("bounded")
    assert bounded < 200, (
        f"RSS grew {bounded:.0f} MB over 600 bf16 matmul shapes (unbounded: {unbounded:.0f} MB)"
    )


# Bytes newly mapped by mmap while a step's 64 MB temporary is held, over ten steps: glibc serves a
# block above its mmap threshold with a fresh mapping (whose pages all fault in again) and unmaps it
# on free; a block served from the heap maps nothing. Counted with mallinfo2, not page faults: on a VM
# whose kernel pages cold memory out (DAMON "pageout", as here), even kept heap pages fault back in
# now and then, which made a page-fault bound fail one run in three.
_MAPPED = """
import ctypes, sys, torch
from worker.platform.cpu_settings import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory(), "mallopt refused"
for _ in range(2):  # a step's large temporary: allocated, written, freed (twice: the heap settles)
    torch.ones(64 << 20, dtype=torch.uint8)
mapped = 0
for _ in range(10):  # ten more steps
    before = mallinfo2().hblkhd
    t = torch.ones(64 << 20, dtype=torch.uint8)
    mapped += max(0, mallinfo2().hblkhd - before)
    del t
print(mapped)
"""


def _mapped_bytes(mode: str) -> int:
    return int(_fresh_interpreter(_MAPPED, mode))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_temporaries_are_reused_not_faulted_in_again() -> None:
    # By default glibc maps each 64 MB block afresh and unmaps it when freed, so every step faults all
    # its pages in again; with keep_freed_memory the heap keeps the block and hands it back.
    default, kept = _mapped_bytes("default"), _mapped_bytes("keep")
    if default < 10 * (64 << 20):
        pytest.skip(f"this allocator reuses large blocks already ({default} bytes mapped for 10 x 64 MB)")
    assert kept == 0, f"{kept} bytes mapped afresh with freed memory kept, {default} without"


# A fresh interpreter (torch's GEMM libraries read their instruction-set setting at their first matmul):
# the settings cap_libraries left in force, then bf16 GEMM FLOP/s over float32's, the engine's probe.
_CAPPED = """
import sys, torch
from worker.platform.cpu_settings import cap_libraries
from worker.platform.probes import gemm_flops
caps = cap_libraries()
print(sorted(caps.items()))
# One thread: a GEMM of two threads with a core taken by another process waits out a time slice for its
# second thread (milliseconds, against float32's fraction of one), which made float32 look as slow as the
# capped bfloat16. A single thread preempted for a whole slice still finishes well inside bf16's time.
torch.set_num_threads(1)
print(gemm_flops(torch.bfloat16, n=256, reps=5) / gemm_flops(torch.float32, n=256, reps=5))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_a_forced_avx2_run_gives_torchs_gemm_libraries_an_avx2_only_machines_instructions() -> None:
    # BATCHQ_CPU_ISA=avx2 stands for an AVX2-only CPU. The kernels' build is one half of that; the other is
    # torch's oneDNN and MKL, which would otherwise keep AVX-512 (and AMX): then the engine's bf16 probe
    # found fast bf16 GEMMs no AVX2-only CPU has, and the AVX2 run's bf16 rows took them.
    clean = {k: v for k, v in os.environ.items() if k not in cpu_settings.LIBRARY_CAPS["avx2"]}

    def run(**env: str) -> tuple[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", _CAPPED], env={**clean, **env}, capture_output=True, text=True, check=True,
            cwd=Path(__file__).parents[2], timeout=300,
        )  # fmt: skip
        caps, ratio = out.stdout.splitlines()[-2:]
        return caps, float(ratio)

    caps, ratio = run(BATCHQ_CPU_ISA="avx2")
    assert caps == "[('MKL_ENABLE_INSTRUCTIONS', 'AVX2'), ('ONEDNN_MAX_CPU_ISA', 'AVX2')]"
    assert ratio < probes.BF16_MIN_SPEEDUP  # what an AVX2-only CPU measures: bf16 never pays there
    # an operator's own setting is kept; native caps nothing
    assert run(BATCHQ_CPU_ISA="avx2", MKL_ENABLE_INSTRUCTIONS="SSE4_2")[0] == (
        "[('MKL_ENABLE_INSTRUCTIONS', 'SSE4_2'), ('ONEDNN_MAX_CPU_ISA', 'AVX2')]"
    )
    assert run(BATCHQ_CPU_ISA="native")[0] == "[]"
