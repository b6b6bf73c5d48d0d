"""linear_bf16dot.c, the batch-invariant bfloat16 engine's linear layers on a CPU with AVX-512 BF16: x and
the weight rounded to bfloat16 and multiplied exactly, summed in float32 in the order of K. Checked against
the float64 product of the rounded operands, and a row's bits against the same row in steps of every other
row count (tiles of 1 to 12 rows and their remainders), for bfloat16, int8, FP8 and group-quantised
weights."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_linear_quantized import dequantised_groups, random_groups
from worker.kernels import native_linear

pytestmark = pytest.mark.skipif(
    not native_linear.has_bf16dot(), reason="this CPU (or build) has no AVX-512 BF16: no bfloat16 products"
)


def bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bfloat16 (to nearest even), as float64."""
    return t.float().bfloat16().double()


def reference(x: torch.Tensor, w: torch.Tensor, scale=None, bias=None) -> torch.Tensor:
    """The exact products of the rounded operands, summed in float64; then scale and bias."""
    y = bf16(x) @ bf16(w).t()
    if scale is not None:
        y = y * scale.double()
    return y if bias is None else y + bias.double()


def check_rows(x: torch.Tensor, run, want: torch.Tensor, tol: float) -> None:
    """The full step is close to the reference, and every row count gives each row the same bits."""
    y = run(x)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=tol)
    for rows in (1, 2, 3, 5, 11, 12, 13, 25):
        part = run(x[:rows].clone())
        assert torch.equal(part, y[:rows]), f"{rows} rows differ from the same rows in a step of {x.shape[0]}"
    assert torch.equal(run(x[-1:].clone())[0], y[-1]), "the last row alone differs"


# columns: a partial panel, whole panels, several panels per thread; an odd K pairs its last row with zeros
@pytest.mark.parametrize(("k", "n"), [(64, 37), (577, 100), (576, 1536), (33, 32)])
def test_bfloat16_weights(k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(30, k, generator=gen)
    packed = native_linear.pack(w)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return native_linear.linear_w(rows, packed, n, bias=bias, bf16_dot=True)

    check_rows(x, run, reference(x, w, bias=bias), 1e-4 * k**0.5)


def test_rounding_is_to_nearest_even_as_torch_rounds() -> None:
    # x values exactly halfway between two bfloat16 neighbours, both parities, and the weight 1 on one input
    k, n = 8, 32
    halfway = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 2**-140, 3.0e38, -0.0, 1.5, 2**-7])
    w = torch.zeros(n, k)
    for i in range(k):
        w[i, i] = 1.0
    y = native_linear.linear_w(halfway[None], native_linear.pack(w.bfloat16()), n, bf16_dot=True)
    assert torch.equal(y[0, :k], halfway.bfloat16().float().masked_fill(halfway.abs() < 2**-126, 0.0) + 0.0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_scaled_weights(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 200
    if kind == "int8":
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale, bias = torch.rand(n, generator=gen) * 0.01 + 0.001, torch.randn(n, generator=gen)
    x = torch.randn(30, k, generator=gen)
    packed = native_linear.pack(w)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return native_linear.linear_w(rows, packed, n, scale=scale, bias=bias, bf16_dot=True)

    check_rows(x, run, reference(x, w.float(), scale, bias), 1e-4)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 128)])
def test_group_quantised_weights_rounded_to_bfloat16(bits: int, group: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    n, k = 65, 256
    q, s, o = random_groups(n, k, group, bits, torch.float16, gen)
    x = torch.randn(30, k, generator=gen)
    # linear.c dequantises in float32 (one fused multiply-add per weight), then rounds to bfloat16
    w = dequantised_groups(q, s, o, group).float()
    stored = native_linear.pack_q4(q) if bits == 4 else native_linear.pack(q)
    gq = native_linear.GroupQuantized(stored, native_linear.pack_groups(s, o, s.dtype), group, bits)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return native_linear.linear_w(rows, gq, n, bf16_dot=True)

    check_rows(x, run, reference(x, w), 2e-3)


def test_a_panel_split_across_threads_gives_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(9)
    n, k = 300, 128
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(17, k, generator=gen)
    packed = native_linear.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_linear.linear_w(x, packed, n, bf16_dot=True)
        torch.set_num_threads(max(2, threads))
        many = native_linear.linear_w(x, packed, n, bf16_dot=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_groups_of_an_odd_number_of_rows_are_refused() -> None:
    # a pair of rows (2k, 2k + 1) must share a group's s and o
    import ctypes

    lib = native_linear.library()
    assert lib is not None
    x, y = torch.randn(2, 6), torch.empty(2, 32)
    q = torch.zeros(1, 6, 16, dtype=torch.uint8)
    for group, refused in ((3, True), (2, False)):
        table = torch.zeros(1, 6 // group, 2, 32)
        spec = native_linear.LinearWeightStruct(
            q.data_ptr(), None, table.data_ptr(), None, native_linear.Q4, group, 0, 1
        )
        rc = lib.batchq_linear_w(x.data_ptr(), ctypes.addressof(spec), y.data_ptr(), 2, 6, 32, 1, None)
        assert (rc != 0) == refused, group
