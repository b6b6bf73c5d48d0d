"""linear.c on the weights it dequantises as it reads them: FP8 E4M3 with a scale per output, and weights
quantised in groups of input rows (4-bit unsigned and 8-bit signed q, w = s * q - o per group and output,
float32 or float16 s and o), against the float64 product with the reference dequantisation."""

from __future__ import annotations

import ctypes
import itertools
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from worker.kernels import native_build, native_linear

pytestmark = pytest.mark.skipif(native_linear.library() is None, reason="no C compiler here")


def random_groups(n: int, k: int, group: int, bits: int, dtype: torch.dtype, gen: torch.Generator):
    """q, s, o of a random group-quantised [n, k] weight (s, o rounded to `dtype`, as a checkpoint ships)."""
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = (torch.rand(n, k // group, generator=gen) * 0.05 + 0.01).to(dtype)
    o = (torch.randn(n, k // group, generator=gen) * 0.2).to(dtype)
    return q, s, o


def dequantised_groups(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, group: int) -> torch.Tensor:
    """The reference dequantisation, float64: w = s * q - o per group of input rows."""
    return q.double() * s.double().repeat_interleave(group, 1) - o.double().repeat_interleave(group, 1)


def reference_groups(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, group: int, bias):
    y = x.double() @ dequantised_groups(q, s, o, group).t()
    return y if bias is None else y + bias.double()


def _use_linear_c_built_with(
    flags: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> SimpleNamespace:
    """native_linear's calls go to linear.c built with `flags` (e.g. a narrower -march) for this test: the
    library, returned, is this test's own."""
    monkeypatch.setenv("BATCHQ_CACHE_DIR", str(tmp_path))
    cc = native_build.compiler()
    assert cc is not None
    lib = native_build.bind(native_build.build(cc, native_linear.SOURCES, flags), native_linear.SIGNATURES)
    monkeypatch.setattr(native_linear, "library", lambda: lib)
    return lib


# Rows: the wide tiles (1-3), the K-blocked path's tiles and their remainders (4-64), the prompt path (> 64);
# columns: a partial panel, whole panels, the per-thread split; groups of 32 (GGUF), 64 and 128 (GPTQ, AWQ).
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16, 33, 64, 70])
@pytest.mark.parametrize(("bits", "group", "k", "n"), [(4, 32, 64, 37), (4, 128, 384, 96), (8, 32, 96, 65),
                                                       (4, 64, 192, 130), (8, 128, 256, 32)])  # fmt: skip
def test_group_quantized_weights_match_the_reference_dequantisation(
    m: int, bits: int, group: int, k: int, n: int
) -> None:
    gen = torch.Generator().manual_seed(m * 100 + n + bits)
    for dtype in (torch.float32, torch.float16):
        q, s, o = random_groups(n, k, group, bits, dtype, gen)
        gq = native_linear.group_quantized(q, s, o, group, bits)
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen) if m % 2 else None

        y = native_linear.linear_w(x, gq, n, bias=bias)

        torch.testing.assert_close(
            y.double(), reference_groups(x, q, s, o, group, bias), rtol=1e-5, atol=1e-4
        )


def test_group_quantized_layout_round_trips() -> None:
    gen = torch.Generator().manual_seed(2)
    for n, k, group, bits in ((1, 32, 32, 4), (33, 64, 32, 4), (70, 128, 64, 8)):
        q, s, o = random_groups(n, k, group, bits, torch.float16, gen)
        gq = native_linear.group_quantized(q, s, o, group, bits)
        assert gq.q.shape == (-(-n // 32), k, 16 if bits == 4 else 32)
        back = native_linear.unpack_q4(gq.q, n) if bits == 4 else native_linear.unpack(gq.q, n)
        assert torch.equal(back, q)
        s2, o2 = native_linear.unpack_groups(gq.groups, n)
        assert torch.equal(s2, s) and torch.equal(o2, o)
        want = q.float() * s.float().repeat_interleave(group, 1) - o.float().repeat_interleave(group, 1)
        torch.testing.assert_close(native_linear.dequantize_groups(gq, n), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3, 6, 20, 80])
def test_fp8_weights_widen_exactly(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    k, n = 160, 75
    w = (torch.randn(n, k, generator=gen) * 3).to(torch.float8_e4m3fn)
    w[0, :8] = torch.tensor(
        [0.0, -0.0, 2.0**-9, -(2.0**-7), 448.0, -448.0, 1.5, 2.0**-6]
    )  # subnormals, extremes
    scale = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(m, k, generator=gen)

    y = native_linear.linear_w(x, native_linear.pack(w), n, scale=scale)

    want = x.double() @ (w.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize(
    "flags", [("-march=x86-64-v3", "-mno-avx512f"), ("-march=x86-64",)], ids=["avx2", "generic"]
)
def test_narrower_instruction_sets_dequantise_alike(
    flags: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_linear_c_built_with(flags, tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(7)
    k, n = 128, 45
    for m, bits, dtype in itertools.product((1, 3, 9, 70), (4, 8), (torch.float32, torch.float16)):
        q, s, o = random_groups(n, k, 32, bits, dtype, gen)
        x = torch.randn(m, k, generator=gen)
        y = native_linear.linear_w(x, native_linear.group_quantized(q, s, o, 32, bits), n)
        torch.testing.assert_close(y.double(), reference_groups(x, q, s, o, 32, None), rtol=1e-5, atol=1e-4)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(5, k, generator=gen)
    y = native_linear.linear_w(x, native_linear.pack(w), n, scale=scale)
    torch.testing.assert_close(
        y.double(), x.double() @ (w.double() * scale.double()[:, None]).t(), rtol=1e-5, atol=1e-4
    )


def test_linear_w_refuses_what_it_cannot_read() -> None:
    lib = native_linear.library()
    assert lib is not None
    x, y = torch.randn(2, 64), torch.empty(2, 32)
    q = torch.zeros(1, 64, 16, dtype=torch.uint8)
    for elem, scale, groups, group in ((native_linear.Q4, None, None, 32), (native_linear.FP8, None, None, 0),
                                       (native_linear.Q4, None, q, 48), (9, None, None, 0)):  # fmt: skip
        spec = native_linear.LinearWeightStruct(
            q.data_ptr(), scale, None if groups is None else groups.data_ptr(), None, elem, group, 0
        )
        rc = lib.batchq_linear_w(x.data_ptr(), ctypes.addressof(spec), y.data_ptr(), 2, 64, 32, 1, None)
        assert rc != 0  # (None: the default tuning)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_linear_layer_keeps_group_quantised_weights_in_either_method(bits: int) -> None:
    from worker.kernels.linear_methods import TORCH_LINEAR, PackedLinear
    from worker.models.layers import Linear

    gen = torch.Generator().manual_seed(bits)
    n, k, group = 70, 128, 32
    q, s, o = random_groups(n, k, group, bits, torch.float16, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(6, k, generator=gen)
    want = reference_groups(x, q, s, o, group, bias)
    lin = Linear(k, n, bias=True)
    lin.load_groups(q, s, o, group, bits)
    lin.bias.data.copy_(bias)  # type: ignore[union-attr]
    for method in (TORCH_LINEAR, PackedLinear(bf16_gemm_rows=0), TORCH_LINEAR):
        lin.use_method(method)
        assert torch.equal(lin.unpacked(), q) and all(map(torch.equal, lin.group_s_o(), (s, o)))
        torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)
        ids = torch.tensor([3, 0, 69])
        torch.testing.assert_close(lin.rows(ids, torch.float32), lin.dequantized(torch.float32)[ids])
    with pytest.raises(ValueError, match="groups of 48"):
        lin.load_groups(q, s, o, 48, bits)


def test_a_linear_layer_keeps_fp8_weights_with_their_scales() -> None:
    from worker.kernels.linear_methods import TORCH_LINEAR, PackedLinear
    from worker.models.layers import Linear

    gen = torch.Generator().manual_seed(8)
    n, k = 40, 96
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(3, k, generator=gen)
    lin = Linear(k, n, bias=False)
    lin.load(w, scale=scale)
    want = x.double() @ (w.double() * scale.double()[:, None]).t()
    for method in (TORCH_LINEAR, PackedLinear(bf16_gemm_rows=0)):
        lin.use_method(method)
        assert lin.weight.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)


Weight = torch.Tensor | native_linear.GroupQuantized


def _weights(
    k: int, n: int, gen: torch.Generator
) -> dict[str, tuple[Weight, torch.Tensor | None, torch.Tensor]]:
    """Every weight type linear.c reads, as linear_w takes it: name -> (weight, scale, float64 [n, k])."""
    w = torch.randn(n, k, generator=gen) / k**0.5
    out: dict[str, tuple[Weight, torch.Tensor | None, torch.Tensor]] = {
        "float32": (native_linear.pack(w), None, w.double()),
        "bfloat16": (native_linear.pack(w.bfloat16()), None, w.bfloat16().double()),
    }
    scale = torch.rand(n, generator=gen) * 0.01 + 0.005
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    out["int8"] = (native_linear.pack(q8), scale, q8.double() * scale.double()[:, None])
    f8 = (w * 8).to(torch.float8_e4m3fn)
    out["fp8"] = (native_linear.pack(f8), scale, f8.double() * scale.double()[:, None])
    for bits in (4, 8):
        q, s, o = random_groups(n, k, 32, bits, torch.float16, gen)
        out[f"q{bits}"] = (
            native_linear.group_quantized(q, s, o, 32, bits),
            None,
            dequantised_groups(q, s, o, 32),
        )
    return out


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("-march=x86-64-v3", "-mno-avx512f"),
        ("-march=x86-64-v3", "-mno-avx512f", "-DGEMM_BLOCKED=0"),
        # tiles of up to 12 rows, AVX-512's (16 rows: 2 x 8), whose code differs from the 6-row tiles of
        # 8-float vectors: built so on every x86 machine, not only where AVX-512 is
        ("-march=x86-64-v3", "-mno-avx512f", "-DMR=12"),
    ],
    ids=["native", "avx2", "avx2-panel-tiles", "avx2-12-row-tiles"],
)
def test_a_rows_answer_is_the_same_whatever_rows_share_its_step(
    flags: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prompt-sized product (here 200 rows: the AVX2 build's GEMM-blocked path, chunks of 96 rows, K in
    # chunks of 256, panels in groups of 16; the panel tiles elsewhere) and a decode-sized one (16 rows:
    # the K-blocked path) must give a row the same answer bit for bit, for every weight type: otherwise a
    # request's text would depend on the batch it was scheduled in. K = 608 = 2 x 256 + 96: two whole K
    # chunks and a remainder that is not a whole block (19 groups of 32); 1,100 outputs: more panels than a
    # group per thread, and a partial last panel, where int8 and FP8 outputs, times their scales, once went
    # out through other code than decode's.
    _use_linear_c_built_with(flags, tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(21)
    k, n = 608, 1100
    x = torch.randn(200, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for name, (weight, scale, ref) in _weights(k, n, gen).items():
        prompt = native_linear.linear_w(x, weight, n, scale=scale, bias=bias)
        for r0 in (0, 90, 184):  # across the 96-row chunks and into the last, short one
            # 16 rows: tiles over a K block (grouped weights dequantised into a buffer first); 1: one row's
            # product in registers; 2 and 5: grouped weights dequantised in registers by one tile of rows
            for m in (16, 1, 2, 5):
                # and with the AVX2 build's measured choices (no-ops elsewhere): few rows through paced
                # 6-row tiles, or 1-3 rows through whole-panel ones
                for pace, wide in ((0, 0), (native_linear.PACE_ROWS, 0), (0, native_linear.WIDE_ROWS)):
                    tuning = native_linear.LinearTuning(wide_rows=wide, pace_rows=pace)
                    rows = native_linear.linear_w(
                        x[r0 : r0 + m], weight, n, scale=scale, bias=bias, tuning=tuning
                    )
                    assert torch.equal(prompt[r0 : r0 + m], rows), (name, r0, m, pace, wide)
        want = x.double() @ ref.t() + bias.double()
        torch.testing.assert_close(prompt.double(), want, rtol=1e-5, atol=1e-4, msg=name)
