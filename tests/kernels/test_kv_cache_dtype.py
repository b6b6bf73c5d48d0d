"""A KV cache narrower than the compute dtype (kv_cache_dtype = bfloat16 or fp8_e4m3 under float32).

The CPU path must attend exactly as float32 attention over the cache's (rounded) values: the cache widens
as it is read, nothing else is rounded. The expected values come from the float32 reference run over a
float32 copy of the narrow cache, so a path that rounded q, the scores or P to the cache's type fails
the float32 tolerance, and a wrong FP8 decoding (sign, exponent bias, subnormals) fails outright.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.paged_cases import GRID, Case, PagedCache, assert_close, build_cache, random_queries
from tests.kernels.test_cpu_attention import cpu_layout
from tests.kernels.test_triton_decode import decode_lengths
from tests.kernels.test_triton_prefill import prefill_lengths
from worker.kernels import native_attention, reference
from worker.kernels.torch_attention import TorchAttention

CPU = torch.device("cpu")
BF16_CASES = [c for c in GRID if c.dtype == torch.bfloat16]
NARROW = [torch.bfloat16, torch.float8_e4m3fn]


def narrowed(cache: PagedCache, dtype: torch.dtype) -> PagedCache:
    """The case's bfloat16 cache in `dtype` (an FP8 cast saturates the garbage slots' huge values)."""
    if dtype == torch.float8_e4m3fn:  # values of every FP8 binade, subnormals (< 2^-6) included
        scale = torch.logspace(-9, 4, cache.k_cache.shape[-1], base=2.0)
        return PagedCache(
            (cache.k_cache.float() * scale).to(dtype), (cache.v_cache.float() * scale).to(dtype),
            cache.block_tables, cache.context_lens,
        )  # fmt: skip
    return cache


@pytest.mark.parametrize("kv_dtype", NARROW, ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_decode_over_a_narrow_cache_is_float32_attention_over_its_values(
    case: Case, native: bool, kv_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(300 + case.seed)
    lens = [*decode_lengths(case, gen), 5, 1999]
    cache = narrowed(build_cache(case, lens, gen, CPU), kv_dtype)  # garbage in every slot no one owns
    q = random_queries(case, len(lens), gen, CPU).float()
    scale = 1 / math.sqrt(case.head_dim)
    if native and not native_attention.supports(q, cache.k_cache):
        assert native_attention.library() is None
        pytest.skip("no C compiler here")

    got = TorchAttention(native=native).paged_decode_attention(
        q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), cache.block_tables, cache.context_lens, scale
    )

    assert got.dtype == torch.float32
    want = reference.paged_decode_attention(
        q, cache.k_cache.float(), cache.v_cache.float(), cache.block_tables, cache.context_lens, scale
    )
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("kv_dtype", NARROW, ids=str)
@pytest.mark.parametrize("new_kv", [True, False], ids=["new-kv", "from-cache"])
@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_prefill_over_a_narrow_cache_is_float32_attention_over_its_values(
    case: Case, new_kv: bool, kv_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(400 + case.seed)
    seqs = prefill_lengths(case)
    cache = narrowed(build_cache(case, [ctx for _, ctx in seqs], gen, CPU), kv_dtype)
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu_seqlens = q_lens.cumsum(0).to(torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, CPU).float()
    scale = 1 / math.sqrt(case.head_dim)
    bs = case.block_size
    kv = {}
    if new_kv:  # this step's K/V as the model hands them over: float32, not yet rounded
        new_k, new_v = [], []
        for b, (n, ctx) in enumerate(seqs):
            pos = torch.arange(ctx - n, ctx)
            slots = cache.block_tables[b, pos // bs].long() * bs + pos % bs
            # within half an ulp (relative 2^-9 in bfloat16, 2^-4 in FP8) of the cached values: lost to rounding
            wobble = 1 + (torch.rand(n, case.kv_heads, case.head_dim, generator=gen) - 0.5) * 1e-3
            new_k.append(cache.k_cache.flatten(0, 1)[slots].float() * wobble)
            new_v.append(cache.v_cache.flatten(0, 1)[slots].float() * wobble)
        kv = {"k": torch.cat(new_k), "v": torch.cat(new_v)}

    got = TorchAttention(native=True).paged_prefill_attention(
        q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), cache.block_tables, cu_seqlens,
        cache.context_lens, scale, **kv,
    )  # fmt: skip

    assert got.dtype == torch.float32
    want = reference.paged_prefill_attention(
        q,
        cache.k_cache.float(),
        cache.v_cache.float(),
        cache.block_tables,
        cu_seqlens,
        cache.context_lens,
        scale,
    )
    assert_close(got, want, torch.float32)
