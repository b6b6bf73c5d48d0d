"""Attention sinks (gpt-oss: a learned logit per head in every softmax's denominator) in every attention
backend, with sliding windows, against the reference's formula: the torch backend's decode (the C kernel
rescaled by its log-sum-exp, and the torch workspace) and prefill (causal tiles, over new K/V and from the
cache); the Triton decode (one split, and split-K's merge) and prefill, on a GPU when there is one, else under
the Triton interpreter; and the reference's sinks against Hugging Face's eager gpt-oss formula written out."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tests.kernels.paged_cases import GRID, Case, assert_close, build_cache, random_queries
from tests.kernels.test_cpu_attention import cpu_layout
from worker.kernels import native_attention, reference
from worker.kernels.torch_attention import TorchAttention

CPU = torch.device("cpu")
CASES = [c for c in GRID if c.dtype == torch.float32]


def sinks_for(case: Case, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(case.heads, generator=gen) * 2  # some far above the scores, some far below


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch-workspace"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_with_sinks_matches_reference(case: Case, native: bool) -> None:
    gen = torch.Generator().manual_seed(500 + case.seed)
    lens = [1, case.block_size + 3, 77, 200]
    q = random_queries(case, len(lens), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    for window in (None, 9):
        cache = build_cache(case, lens, gen, CPU)
        kc, vc = cpu_layout(cache.k_cache), cpu_layout(cache.v_cache)
        if native and not native_attention.supports(q, kc):
            pytest.skip("no C kernel here")
        sinks = sinks_for(case, gen)
        got = TorchAttention(native=native).paged_decode_attention(
            q, kc, vc, cache.block_tables, cache.context_lens, scale, window=window, sinks=sinks
        )
        want = reference.paged_decode_attention(
            q,
            cache.k_cache,
            cache.v_cache,
            cache.block_tables,
            cache.context_lens,
            scale,
            window,
            None,
            sinks,
        )
        assert_close(got, want, case.dtype)
        plain = reference.paged_decode_attention(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale, window
        )
        assert not torch.allclose(want, plain, atol=1e-3)  # the sinks change the output


@pytest.mark.parametrize("new_kv", [True, False], ids=["new-kv", "from-cache"])
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_prefill_with_sinks_matches_reference(case: Case, new_kv: bool) -> None:
    gen = torch.Generator().manual_seed(600 + case.seed)
    bs = case.block_size
    seqs = [(1, 1), (2 * bs + 5, 2 * bs + 5), (7, 60), (40, 40)]
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu = q_lens.cumsum(0).to(torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    for window in (None, 6):
        cache = build_cache(case, [ctx for _, ctx in seqs], gen, CPU)
        kv = {}
        if new_kv:
            slots = [cache.block_tables[b, p // bs].long() * bs + p % bs
                     for b, (n, ctx) in enumerate(seqs) for p in [torch.arange(ctx - n, ctx)]]  # fmt: skip
            kv = {"k": torch.cat([cache.k_cache.flatten(0, 1)[s] for s in slots]),
                  "v": torch.cat([cache.v_cache.flatten(0, 1)[s] for s in slots])}  # fmt: skip
        sinks = sinks_for(case, gen)
        got = TorchAttention(native=True).paged_prefill_attention(
            q, cpu_layout(cache.k_cache), cpu_layout(cache.v_cache), cache.block_tables, cu, cache.context_lens,
            scale, window=window, sinks=sinks, **kv,
        )  # fmt: skip
        want = reference.paged_prefill_attention(
            q,
            cache.k_cache,
            cache.v_cache,
            cache.block_tables,
            cu,
            cache.context_lens,
            scale,
            window,
            None,
            sinks,
        )
        assert_close(got, want, case.dtype)


def test_the_reference_sinks_are_gpt_oss_eager_formula() -> None:
    """Hugging Face's eager gpt-oss attention: softmax over [scores, sink] less the row max, sink dropped."""
    gen = torch.Generator().manual_seed(0)
    h, n, d = 4, 11, 16
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    sinks = torch.randn(h, generator=gen)
    ours = reference._attend(q, k, v, d**-0.5, 0, None, None, sinks)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    logits = torch.cat([scores, sinks.view(h, 1, 1).expand(h, n, 1)], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    torch.testing.assert_close(ours, torch.einsum("hqk,khd->qhd", probs, v))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("case", GRID[:4], ids=str)
def test_triton_decode_with_sinks_matches_reference(
    kernels: ModuleType, device: torch.device, case: Case, num_splits: int
) -> None:
    gen = torch.Generator().manual_seed(700 + case.seed)
    lens = [1, case.block_size + 1, 77, 300]
    q = random_queries(case, len(lens), gen, device)
    scale = 1 / math.sqrt(case.head_dim)
    for window in (None, 40):
        cache = build_cache(case, lens, gen, device)
        sinks = sinks_for(case, gen)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
        got = kernels.paged_decode_attention(
            *args, num_splits=num_splits, window=window, sinks=sinks.to(device)
        )
        assert_close(got, reference.paged_decode_attention(*args, window, None, sinks.to(device)), case.dtype)


@pytest.mark.parametrize("case", GRID[:4], ids=str)
def test_triton_prefill_with_sinks_matches_reference(
    kernels: ModuleType, device: torch.device, case: Case
) -> None:
    gen = torch.Generator().manual_seed(800 + case.seed)
    bs = case.block_size
    seqs = [(1, 1), (2 * bs + 5, 2 * bs + 5), (7, 90), (70, 70)]
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu = q_lens.cumsum(0).to(device=device, dtype=torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, device)
    scale = 1 / math.sqrt(case.head_dim)
    for window in (None, 6):
        cache = build_cache(case, [ctx for _, ctx in seqs], gen, device)
        sinks = sinks_for(case, gen).to(device)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, scale)
        got = kernels.paged_prefill_attention(*args, window=window, sinks=sinks)
        assert_close(got, reference.paged_prefill_attention(*args, window, None, sinks), case.dtype)
