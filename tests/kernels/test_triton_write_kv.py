"""Triton KV write scatters exactly the slots the reference does and leaves every other slot alone."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.kernels.paged_cases import GRID, Case, garbage_cache
from worker.kernels import reference


def qkv_views(
    case: Case, tokens: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    # k, v: [tokens, kv_heads, head_dim] sliced out of one fused projection, so their token stride is
    # not kv_heads * head_dim, as in a model's fused qkv output. Sliced last: .to() would compact them.
    qkv = torch.randn(tokens, case.heads + 2 * case.kv_heads, case.head_dim, generator=gen)
    qkv = qkv.to(device=device, dtype=dtype)
    k, v = qkv[:, case.heads : case.heads + case.kv_heads], qkv[:, case.heads + case.kv_heads :]
    assert not k.is_contiguous()
    return k, v


@pytest.mark.parametrize("case", GRID[::2], ids=str)
def test_write_kv_scatters_into_shuffled_slots(kernels: ModuleType, device: torch.device, case: Case) -> None:
    gen = torch.Generator().manual_seed(200 + case.seed)
    num_blocks, tokens = 6, 45
    k_cache, v_cache = garbage_cache(case, num_blocks, gen)
    slots = torch.randperm(num_blocks * case.block_size, generator=gen)[:tokens]
    k, v = qkv_views(case, tokens, case.dtype, device, gen)  # cache dtype: the copy must be exact
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k.cpu(), v.cpu(), want_k, want_v, slots)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)

    kernels.write_kv(k, v, k_cache, v_cache, slots.to(device))

    # Exact, NaN garbage included: untouched slots must still hold their garbage.
    torch.testing.assert_close(k_cache.cpu(), want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), want_v, atol=0, rtol=0, equal_nan=True)


def test_write_kv_casts_float32_into_a_bfloat16_cache(kernels: ModuleType, device: torch.device) -> None:
    case = GRID[2]
    gen = torch.Generator().manual_seed(31)
    k_cache, v_cache = garbage_cache(case, 2, gen)
    slots = torch.tensor([5, 0, 63, 32], dtype=torch.int32)
    k, v = qkv_views(case, 4, torch.float32, device, gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k.cpu(), v.cpu(), want_k, want_v, slots.long())
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)

    kernels.write_kv(k, v, k_cache, v_cache, slots.to(device))

    # One bf16 ulp: the interpreter truncates fp32 -> bf16 where torch rounds to nearest.
    torch.testing.assert_close(k_cache.cpu(), want_k, atol=0, rtol=2**-7, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), want_v, atol=0, rtol=2**-7, equal_nan=True)
