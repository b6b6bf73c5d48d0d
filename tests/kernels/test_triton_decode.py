"""Triton paged decode attention matches the torch reference over the kernel grid."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tests.kernels.paged_cases import GRID, Case, assert_close, build_cache, poisoned_like, random_queries
from worker.kernels import reference


def decode_lengths(case: Case, gen: torch.Generator) -> list[int]:
    # One token, exact block multiples, one past and one short of a block boundary, a random middle
    # length, and the 2,000-token context.
    bs = case.block_size
    middle = int(torch.randint(50, 700, (1,), generator=gen))
    return [1, bs, 4 * bs, bs + 1, 3 * bs - 1, middle, 2000]


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize("case", GRID, ids=str)
def test_decode_matches_reference(
    kernels: ModuleType, device: torch.device, case: Case, num_splits: int | None
) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    cache = build_cache(case, decode_lengths(case, gen), gen, device)
    q = random_queries(case, cache.context_lens.shape[0], gen, device)
    scale = 1 / math.sqrt(case.head_dim)
    out = poisoned_like(q)

    got = kernels.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale,
        num_splits=num_splits, out=out,
    )  # fmt: skip

    assert got is out
    want = reference.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
    )
    assert_close(got, want, case.dtype)


def test_decode_with_more_splits_than_a_short_context_fills(
    kernels: ModuleType, device: torch.device
) -> None:
    # Splits that start past a sequence's context must contribute nothing (and no NaN) to the merge.
    case = GRID[2]
    gen = torch.Generator().manual_seed(11)
    cache = build_cache(case, [1, 70, 600], gen, device)
    q = random_queries(case, 3, gen, device)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)

    got = kernels.paged_decode_attention(*args, num_splits=8, block_n=16)

    assert_close(got, reference.paged_decode_attention(*args), case.dtype)
