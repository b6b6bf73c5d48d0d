"""The Triton GEMM over quantised weights (worker/kernels/triton_quant.py) against the float64 product with
the reference dequantisation: 4-bit and 8-bit groups (GGUF's, GPTQ's and AWQ's group sizes), FP8 with a
scale per output; on a GPU when there is one, else under the Triton interpreter."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from tests.kernels.conftest import ON_GPU


@pytest.fixture(scope="module")
def tq() -> ModuleType:
    mod = importlib.import_module("worker.kernels.triton_quant")
    if not ON_GPU and not isinstance(mod.quant_gemm_kernel, InterpretedFunction):
        mod = importlib.reload(sys.modules["worker.kernels.triton_quant"])
    return mod


def groups(n: int, k: int, group: int, bits: int, gen: torch.Generator):
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    o = torch.randn(n, k // group, generator=gen) * 0.2
    return q, s, o


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize(("bits", "group", "k", "n"), [(4, 32, 64, 70), (4, 128, 256, 64), (8, 16, 96, 33),
                                                       (8, 64, 128, 130)])  # fmt: skip
def test_group_quantised_gemm_matches_the_reference(
    tq: ModuleType, device: torch.device, m: int, bits: int, group: int, k: int, n: int
) -> None:
    gen = torch.Generator().manual_seed(m + n + bits)
    q, s, o = groups(n, k, group, bits, gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    w = q.double() * s.double().repeat_interleave(group, 1) - o.double().repeat_interleave(group, 1)
    want = x.double() @ w.t() + bias.double()
    stored = tq.pack_q4_rows(q) if bits == 4 else q
    assert torch.equal(tq.unpack_q4_rows(stored), q) if bits == 4 else True
    for dtype, table_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float16)):
        table = torch.stack((s, o), dim=-1).to(table_dtype)
        got = tq.quant_linear(
            x.to(dtype).to(device), stored.to(device), n, table.to(device), group, bits, bias=bias.to(device)
        )
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol * 10)


def test_fp8_gemm_scales_each_output(tq: ModuleType, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    n, k = 48, 128
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(7, k, generator=gen)
    got = tq.quant_linear(x.to(device), w.to(device), n, scale=scale.to(device))
    want = x.double() @ (w.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-3)


def test_a_group_the_step_cannot_divide_is_refused(tq: ModuleType) -> None:
    with pytest.raises(ValueError, match="groups of 24"):
        tq._block_k(24, 96)


def test_a_linear_layer_runs_quantised_weights_through_the_triton_method(
    tq: ModuleType, device: torch.device
) -> None:
    from worker.kernels.linear_methods import TORCH_LINEAR, TritonLinear
    from worker.models.layers import Linear

    gen = torch.Generator().manual_seed(9)
    n, k, group = 40, 128, 32
    q, s, o = groups(n, k, group, 4, gen)
    x = torch.randn(3, k, generator=gen).to(device)
    lin = Linear(k, n, bias=False)
    lin.load_groups(q, s, o, group, 4)
    lin.to(device)
    want = lin(x)  # the torch method: dequantised per call
    lin.use_method(TritonLinear())
    assert lin.weight.shape == (n, k // 2) and torch.equal(lin.unpacked().cpu(), q)
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    ids = torch.tensor([0, 39, 7], device=device)
    torch.testing.assert_close(lin.rows(ids, torch.float32), lin.dequantized(torch.float32)[ids])
    lin.use_method(TORCH_LINEAR)
    assert torch.equal(lin.unpacked().cpu(), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_invariant_gemm_gives_a_row_the_same_bits_at_every_row_count(
    tq: ModuleType, device: torch.device, bits: int
) -> None:
    # One row tile at every M (the compiled kernel never follows the step's rows): each row alone, and in
    # steps of 16, 32 and 70 rows (where the default picks tiles of 16, 32 and 64), has the same bits.
    gen = torch.Generator().manual_seed(bits)
    n, k, group = 70, 128, 32
    q, s, o = groups(n, k, group, bits, gen)
    stored = (tq.pack_q4_rows(q) if bits == 4 else q).to(device)
    table = torch.stack((s, o), dim=-1).to(torch.float16).to(device)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16).to(device)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return tq.quant_linear(rows, stored, n, table, group, bits, invariant=True)

    full = run(x)
    for m in (1, 16, 32):
        assert torch.equal(run(x[:m].contiguous()), full[:m]), f"{m} rows"
    assert torch.equal(run(x[-1:].contiguous()), full[-1:])
