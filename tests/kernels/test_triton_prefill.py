"""Triton causal prefill attention matches the torch reference, with and without a cached prefix."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tests.kernels.paged_cases import GRID, Case, assert_close, build_cache, poisoned_like, random_queries
from worker.kernels import reference


def prefill_lengths(case: Case) -> list[tuple[int, int]]:
    """(new tokens, context length) per sequence; context > new tokens means a cached prefix."""
    bs = case.block_size
    seqs = [
        (1, 1),  # one-token prompt
        (bs, bs),  # exactly one block
        (2 * bs + 5, 2 * bs + 5),  # past a block boundary
        (bs - 3, 4 * bs - 3),  # continues a 3-block cached prefix
        (7, 300),  # prefix that ends inside a block
        (1, 129),  # a single new token over a long prefix
    ]
    # A whole 2,000-token prompt costs the interpreter 15-30 s with 3+ query heads: run it whole for up to
    # 2 heads (the group-1 cases), otherwise as 64 new tokens over a 2,000-token context.
    seqs.append((2000, 2000) if case.heads <= 2 else (64, 2000))
    return seqs


@pytest.mark.parametrize("case", GRID, ids=str)
def test_prefill_matches_reference(kernels: ModuleType, device: torch.device, case: Case) -> None:
    gen = torch.Generator().manual_seed(100 + case.seed)
    seqs = prefill_lengths(case)
    perm = torch.randperm(len(seqs), generator=gen).tolist()  # the long sequence is not always last
    seqs = [seqs[i] for i in perm]
    cache = build_cache(case, [ctx for _, ctx in seqs], gen, device)
    q_lens = torch.tensor([0] + [n for n, _ in seqs])
    cu_seqlens = q_lens.cumsum(0).to(device=device, dtype=torch.int32)
    q = random_queries(case, int(q_lens.sum()), gen, device)
    scale = 1 / math.sqrt(case.head_dim)
    out = poisoned_like(q)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu_seqlens, cache.context_lens, scale)

    got = kernels.paged_prefill_attention(*args, out=out)

    assert got is out
    assert_close(got, reference.paged_prefill_attention(*args), case.dtype)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 128)])
def test_prefill_tile_sizes_other_than_the_default(
    kernels: ModuleType, device: torch.device, block_m: int, block_n: int
) -> None:
    # Tiles smaller and larger than a cache block (with group 3, a 16-row tile holds 5 tokens), and a
    # strided q.
    case = GRID[3]
    gen = torch.Generator().manual_seed(21)
    seqs = [(40, 40), (1, 17), (33, 97)]
    cache = build_cache(case, [ctx for _, ctx in seqs], gen, device)
    cu_seqlens = torch.tensor([0, 40, 41, 74], dtype=torch.int32, device=device)
    # q as the query part of a fused qkv output: its token stride is not heads * head_dim.
    q = torch.cat([random_queries(case, 74, gen, device)] * 2, dim=1)[:, : case.heads]
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu_seqlens, cache.context_lens, 0.2)

    got = kernels.paged_prefill_attention(*args, block_m=block_m, block_n=block_n, out=poisoned_like(q))

    assert_close(got, reference.paged_prefill_attention(*args), case.dtype)
