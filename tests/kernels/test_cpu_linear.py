"""The C linear kernel (linear.c) against a float64 reference: every row/column remainder of its tiles and
panels, with and without bias, float32, bfloat16 and int8 weights; the packed layout; and the Linear
layer's methods (linear_methods.py)."""

from __future__ import annotations

import ctypes
import itertools
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from worker.kernels import native_build, native_linear
from worker.kernels.linear_methods import TORCH_LINEAR, PackedLinear
from worker.kernels.native_linear import DEFAULT_TUNING, PACE_ROWS, WIDE_ROWS, LinearTuning
from worker.models.layers import Linear, RMSNorm, RotaryTable, apply_rotary

pytestmark = pytest.mark.skipif(native_linear.library() is None, reason="no C compiler here")
PACKED = PackedLinear(bf16_gemm_rows=0)  # linear.c on every row count


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None):
    wd = w.double() * (scale.double()[:, None] if scale is not None else 1.0)
    y = x.double() @ wd.t()
    return y + bias.double() if bias is not None else y


# rows: every remainder of the 6- and 8-row tiles, and many tiles; columns: one column, remainders of the
# 16-column tiles and 32-column panels, and of the per-thread split; K: any size.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33, 70])
@pytest.mark.parametrize(("k", "n"), [(16, 1), (64, 7), (5, 40), (576, 960), (1536, 577), (48, 4099)])
def test_float32_matches_float64(m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) if n % 2 else None

    y = native_linear.linear(x, native_linear.pack(w), None, bias, n)

    want = reference(x, w, None, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("m", [1, 6, 40])
def test_narrow_weights_widen_exactly(dtype: torch.dtype, m: int) -> None:
    # The kernel's answer is x times the stored weight as it is (widened exactly), so the reference uses
    # the same rounded weight: only float32 accumulation separates them.
    gen = torch.Generator().manual_seed(m)
    k, n = 320, 203
    x = torch.randn(m, k, generator=gen)
    lin = Linear(k, n, bias=True)
    lin.load(torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen))
    lin.quantize(dtype)
    lin.use_method(PACKED)
    assert lin.weight.dtype == dtype and (lin.scale is not None) == (dtype == torch.int8)

    y = native_linear.linear(x, lin.weight, lin.scale, lin.bias, n)

    want = reference(x, lin.unpacked().float(), lin.scale, lin.bias)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=2e-5)
    # ... and the torch fallback (F.linear over the dequantized weight) agrees with it.
    torch.testing.assert_close(torch.nn.functional.linear(x, lin.dequantized(torch.float32), lin.bias), y)


def test_int8_rows_round_to_their_own_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(50, 64, generator=gen) * torch.logspace(-3, 2, 50)[:, None]  # rows of very unlike size
    lin = Linear(64, 50, bias=False)
    lin.load(w)
    lin.quantize(torch.int8)
    assert lin.scale is not None
    assert int(lin.weight.abs().amax(1).min()) == 127  # every row uses its full range
    err = (lin.dequantized(torch.float32) - w).abs().amax(1)
    assert bool((err <= lin.scale / 2 + 1e-12).all())  # round-to-nearest: half a step per row at most


def test_pack_unpack_and_rows_round_trip() -> None:
    gen = torch.Generator().manual_seed(1)
    for n, k in ((1, 3), (31, 8), (32, 8), (33, 5), (100, 16)):
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            w = (torch.randn(n, k, generator=gen) * 50).to(dtype)
            packed = native_linear.pack(w)
            assert (
                packed.shape == (-(-n // native_linear.PANEL), k, native_linear.PANEL)
                and packed.dtype == dtype
            )
            assert native_linear.is_packed(packed, n, k)
            assert torch.equal(native_linear.unpack(packed, n), w)
            tail = n - (packed.shape[0] - 1) * native_linear.PANEL
            assert not packed[-1, :, tail:].float().any()  # the last panel's padding columns are zeros
            ids = torch.randint(0, n, (7,), generator=gen)
            assert torch.equal(native_linear.packed_rows(packed, ids), w[ids])


def test_linear_layer_packs_for_the_kernel_and_back() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    lin = Linear(40, 24, bias=True)
    lin.load(w, b)
    x = torch.randn(5, 40, generator=gen)
    want = lin(x)  # F.linear on [out, in]
    assert lin.method is TORCH_LINEAR and torch.equal(want, torch.nn.functional.linear(x, w, b))
    lin.use_method(PACKED)
    assert lin.weight.shape == (1, 40, 32) and torch.equal(lin.unpacked(), w)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 23, 5])
    assert torch.equal(lin.rows(ids, torch.float32), w[ids])  # a tied embedding's lookup
    lin.load(w * 2, b)  # loading into a packed layer packs
    assert torch.equal(lin.unpacked(), w * 2)
    lin.use_method(TORCH_LINEAR)
    assert lin.weight.shape == (24, 40) and torch.equal(lin.weight, w * 2)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w * 2, b))
    assert not native_linear.linear_supports(x.bfloat16(), torch.empty(24, 48))  # bfloat16 activations: torch
    assert native_linear.linear_supports(torch.empty(5, 48), torch.empty(24, 48, dtype=torch.bfloat16))


@pytest.mark.parametrize("t", [1, 7, 300])
def test_rmsnorm_matches_the_torch_formula(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x = torch.randn(t, 576, generator=gen) * 3
    want = norm(x)  # the torch path (the backend has not given it the C rows)

    got = native_linear.rmsnorm(x, norm.weight, norm.eps)

    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("t", [1, 9, 70])
def test_silu_mul_matches_silu_times_up(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    inter = 1536 + 5  # not a whole number of vectors
    gate_up = torch.randn(t, 2 * inter, generator=gen) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30, -200.0, 200.0, -1e-30])
    want = torch.nn.functional.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()

    got = native_linear.silu_mul(gate_up, inter)

    assert got.shape == (t, inter) and got.dtype == torch.float32
    # float32 roundings, and a few more where e^x is small (x * log2 e rounded before the polynomial); below
    # e^-87 the exponential stops at e^-87 (silu(-200) * up ~ 1e-36, not 0)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])


@pytest.mark.parametrize("t", [1, 5, 130])
def test_rotary_in_place_matches_the_torch_formula_on_a_fused_qkv_view(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    heads, kv_heads, d = 9, 3, 64
    table = RotaryTable(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0, 512)
    cos, sin = table(torch.randint(0, 512, (t,), generator=gen), torch.float32)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)
    want_q, want_k, want_v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()

    apply_rotary(q, cos, sin, in_place=native_linear.rotary_)
    apply_rotary(k, cos, sin, in_place=native_linear.rotary_)

    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, want_v)  # the V columns of the fused output are left alone


def _load_for(flags: tuple[str, ...]) -> SimpleNamespace:
    cc = native_build.compiler()
    assert cc is not None
    return native_build.bind(native_build.build(cc, native_linear.SOURCES, flags), native_linear.SIGNATURES)


def _packed(k: int, n: int, dtype: torch.dtype, gen: torch.Generator, bias: bool) -> Linear:
    """A random packed Linear(k, n) stored as dtype (float32, bfloat16 or int8)."""
    lin = Linear(k, n, bias=bias)
    lin.load(torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen) if bias else None)
    if dtype != torch.float32:
        lin.quantize(dtype)
    lin.use_method(PACKED)
    return lin


def _c_linear(
    lib: SimpleNamespace,
    x: Tensor,
    lin: Linear,
    out: Tensor | None = None,
    tuning: LinearTuning = DEFAULT_TUNING,
) -> Tensor:
    """lin(x) through `lib`'s batchq_linear on 2 threads under `tuning`, into `out` ([m, n], rows
    contiguous) if given."""
    m, k = x.shape
    n = lin.out_features
    y = torch.empty(m, n) if out is None else out
    assert lib.batchq_linear(
        x.data_ptr(), lin.weight.data_ptr(), None if lin.scale is None else lin.scale.data_ptr(),
        None if lin.bias is None else lin.bias.data_ptr(), y.data_ptr(), m, k, n,
        native_linear.WEIGHT_TYPES[lin.weight.dtype], 2, ctypes.byref(tuning),
    ) == 0  # fmt: skip
    return y


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize(
    "flags", [("-march=x86-64-v3", "-mno-avx512f"), ("-march=x86-64",)], ids=["avx2", "generic"]
)
def test_narrower_instruction_sets_give_the_same_answers(
    flags: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The AVX2 path (8-float vectors, its own widenings, half-panel tiles at every row count) and the
    # generic one, built on this machine with a narrower -march: AVX-512 machines then test what AVX2-only
    # CPUs run. 37 outputs: a whole panel and a partial one.
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    lib = _load_for(flags)
    gen = torch.Generator().manual_seed(11)
    k, n = 96, 37
    for m, dtype in itertools.product(
        (1, 2, 3, 4, 9, 16, 33, 70), (torch.float32, torch.bfloat16, torch.int8)
    ):
        x = torch.randn(m, k, generator=gen)
        lin = _packed(k, n, dtype, gen, bias=True)
        want = reference(x, lin.unpacked().float(), lin.scale, lin.bias)
        torch.testing.assert_close(_c_linear(lib, x, lin).double(), want, rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_decode_steps_sum_each_k_block_the_same_whatever_rows_the_tiles_take_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The AVX2 decode path goes through a K block in pieces (KB_SUB rows), carrying the tiles' partial sums
    # over: the outputs must be those of the block summed in one piece, bit for bit, for every weight type
    # and tile shape (whole-panel tiles up to 3 rows, half-panel ones beyond), and K not a multiple of it.
    # (KB_WHOLE: the rows per weight byte at which blocks go whole; here never, so every type goes in pieces.)
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    avx2 = ("-march=x86-64-v3", "-mno-avx512f")
    whole = _load_for((*avx2, "-DKB_SUB=64"))
    pieces = _load_for((*avx2, "-DKB_SUB=16", "-DKB_WHOLE=1000"))
    gen = torch.Generator().manual_seed(5)
    for m, k, dtype in itertools.product(
        (1, 3, 4, 9, 16, 64), (200, 576), (torch.float32, torch.bfloat16, torch.int8)
    ):
        x = torch.randn(m, k, generator=gen)
        lin = _packed(k, 40, dtype, gen, bias=False)
        ys = [
            _c_linear(lib, x, lin, tuning=LinearTuning(wide_rows=wide, pace_rows=pace))
            for lib, wide, pace in itertools.product((whole, pieces), (0, WIDE_ROWS), (0, PACE_ROWS))
        ]
        assert all(torch.equal(ys[0], y) for y in ys[1:]), (m, k, dtype)


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_the_prefetch_settings_change_no_answer(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prefetcht0 or prefetchnta, and the far prefetch into L2 of decode-sized steps, are each machine's
    # choices by speed (LinearTuning's prefetch_t0, far_prefetch): only when weights arrive may depend on
    # them. Decode- and prompt-sized steps, every directly read weight type; the AVX2 build is the one whose
    # decode steps of every weight type take the K-block tiles that prefetch far.
    if isa == "native":
        lib = native_linear.library()
        assert lib is not None
    elif platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 instruction set")
    else:
        monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
        lib = _load_for(("-march=x86-64-v3", "-mno-avx512f"))
    gen = torch.Generator().manual_seed(9)
    for m, dtype in itertools.product((1, 5, 16, 96), (torch.float32, torch.bfloat16, torch.int8)):
        x = torch.randn(m, 200, generator=gen)
        lin = _packed(200, 70, dtype, gen, bias=True)
        ys = [
            _c_linear(lib, x, lin, tuning=LinearTuning(prefetch_t0=t0, far_prefetch=far))
            for t0, far in itertools.product((0, 1), (0, 1))
        ]
        assert all(torch.equal(ys[0], y) for y in ys[1:]), (m, dtype)


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_a_build_says_which_knobs_it_can_change(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The prefetch hint everywhere; the far prefetch, whole-panel and paced tiles only where a tile covers
    # half a panel (8-float vectors: the AVX2 build, and native on a CPU without AVX-512).
    if isa == "avx2":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("an x86 instruction set")
        monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(native_linear, "library", lambda: _load_for(("-march=x86-64-v3", "-mno-avx512f")))
    native_isa = native_build.cpu_isa() == "native" and "avx512f" in native_build.cpu_features().split()
    narrow = isa == "avx2" or not native_isa  # (BATCHQ_CPU_ISA=avx2 makes native_linear's build AVX2's)
    every = {"prefetch_t0", "far_prefetch", "wide_rows", "pace_rows"}
    assert native_linear.tunable() == (every if narrow else {"prefetch_t0"})


def test_a_tuning_is_checked_by_name_and_fixed_once_made() -> None:
    tuning = LinearTuning.from_dict({"prefetch_t0": 1, "wide_rows": WIDE_ROWS})
    assert tuning.as_dict() == {"prefetch_t0": 1, "far_prefetch": 0, "wide_rows": WIDE_ROWS, "pace_rows": 0}
    assert LinearTuning.from_dict(tuning.as_dict()) == tuning
    assert LinearTuning.from_dict({}) == DEFAULT_TUNING == LinearTuning(0, 0, 0, 0)
    refused = [
        ({"wide_rows": WIDE_ROWS + 1}, "wide_rows 4"),  # no whole-panel tiles of 4 rows
        ({"pace_rows": 3}, "pace_rows 3"),  # paced through a full tile or not at all
        ({"far_prefetch": 2}, "far_prefetch 2"),
        ({"prefetch_t0": 1.0}, "prefetch_t0 1.0"),
        ({"prefetch": 1}, "no knob 'prefetch'"),
    ]
    for knobs, message in refused:
        with pytest.raises(ValueError, match=message):
            LinearTuning.from_dict(knobs)
    with pytest.raises(AttributeError, match="fixed once made"):
        DEFAULT_TUNING.wide_rows = WIDE_ROWS  # the default every caller shares stays the default


def test_bf16_weights_take_the_bf16_gemm_from_a_row_count_on() -> None:
    gen = torch.Generator().manual_seed(4)
    lin = Linear(64, 48, bias=True)
    lin.load(torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen))
    lin.quantize(torch.bfloat16)
    lin.use_method(PackedLinear(bf16_gemm_rows=4))
    small, big = torch.randn(3, 64, generator=gen), torch.randn(4, 64, generator=gen)

    # Below the threshold: linear.c, float32 activations times the stored weight, exactly as the kernel.
    assert torch.equal(lin(small), native_linear.linear(small, lin.weight, None, lin.bias, 48))
    # From it on: bf16 activations through torch's GEMM, float32 out, close to the float32-activation answer.
    got = lin(big)
    assert got.dtype == torch.float32
    want = reference(big, lin.unpacked().float(), None, lin.bias).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
    assert not torch.equal(got, native_linear.linear(big, lin.weight, None, lin.bias, 48))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_whole_half_and_paced_tiles_give_the_same_answers_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 8-float vectors, decode steps of 1-3 rows take whole-panel tiles or two half-panel passes, and
    # steps of fewer rows than a tile holds may run through a full tile whose idle rows repeat row 0 (paced):
    # each the machine's choice by speed (LinearTuning's wide_rows, pace_rows). The answers, and so the
    # result cache's, must not depend on them, and an idle row must never reach y. 70 outputs: two whole
    # panels and a partial one; K not a multiple of the block. A tuning past the tiles the build has (made
    # without from_dict's checks) is clamped to them, never read past its tables.
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    lib = _load_for(("-march=x86-64-v3", "-mno-avx512f"))
    gen = torch.Generator().manual_seed(8)
    k, n = 200, 70
    for m, dtype in itertools.product((1, 2, 3, 4, 5, 6), (torch.float32, torch.bfloat16, torch.int8)):
        x = torch.randn(m, k, generator=gen)
        lin = _packed(k, n, dtype, gen, bias=True)
        ys = []
        for wide, pace in [*itertools.product((0, WIDE_ROWS), (0, PACE_ROWS)), (9, 1), (-1, 99)]:
            y = torch.full((m + 1, n), 7.0)  # a row past m: an idle row's sums written out would land there
            ys.append(_c_linear(lib, x, lin, out=y[:m], tuning=LinearTuning(wide_rows=wide, pace_rows=pace)))
            assert torch.equal(y[m], torch.full((n,), 7.0)), (m, dtype, wide, pace)
        assert all(torch.equal(ys[0], y) for y in ys[1:]), (m, dtype)
        want = reference(x, lin.unpacked().float(), lin.scale, lin.bias)
        torch.testing.assert_close(ys[0].double(), want, rtol=1e-5, atol=2e-5)
