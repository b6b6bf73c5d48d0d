"""What a batch-invariant CUDA engine runs (backend.select_backend under batch_invariant): its linears through
triton_invariant's fixed-tile GEMM, its RMSNorm one row per program, its decode in fixed-size KV splits.
Under the Triton interpreter where there is no GPU (the kernels' own tests: test_triton_invariant.py)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from worker.kernels.backend import triton_attention
from worker.kernels.linear_methods import TritonLinear
from worker.models.layers import RMSNorm


def test_the_invariant_triton_linear_takes_the_fixed_tile_gemm(
    kernels: ModuleType, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=gen).to(device)
    b = torch.randn(40, generator=gen).to(device)
    x = torch.randn(9, 24, generator=gen).to(device)
    lin = TritonLinear(invariant=True)
    y = lin.apply(x, lin.store(w), None, b, 40)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for i in (0, 4, 8):  # each row alone: the same bits
        assert torch.equal(lin.apply(x[i : i + 1], w, None, b, 40), y[i : i + 1])
    assert not TritonLinear().invariant  # batch_invariant = false keeps cuBLAS


def test_rmsnorm_takes_the_backends_row_kernel_in_both_forms(
    kernels: ModuleType, device: torch.device
) -> None:
    import sys

    tri = sys.modules["worker.kernels.triton_invariant"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 48, generator=gen).to(device)
    for plus_one in (False, True):
        norm = RMSNorm(48, 1e-6, plus_one=plus_one).to(device)
        norm.weight.data = torch.randn(48, generator=gen).to(device)
        want = norm(x)
        norm.norm_rows = tri.rmsnorm
        got = norm(x)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        assert torch.equal(norm(x[2:3]), got[2:3])


def test_invariant_triton_decode_splits_by_a_fixed_size(kernels: ModuleType) -> None:
    decode = triton_attention(invariant=True).paged_decode_attention
    assert decode.keywords == {"split_tokens": kernels.INVARIANT_SPLIT_TOKENS}  # type: ignore[attr-defined]
    assert triton_attention().paged_decode_attention is kernels.paged_decode_attention
