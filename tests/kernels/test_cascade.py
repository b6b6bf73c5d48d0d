"""Cascade decode attention (worker/kernels/cascade.py): sequences sharing prefix blocks, against the reference.

Sequences of a group point at the very same physical blocks for their shared prefix, as the prefix cache
makes them; every other slot holds garbage (huge values, NaN), as in the other kernel tests.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.paged_cases import GRID, Case, assert_close, build_cache, random_queries
from tests.kernels.test_cpu_attention import cpu_layout
from worker.kernels import native_attention, reference
from worker.kernels.cascade import MIN_SHARED_TOKENS, shared_prefixes
from worker.kernels.torch_attention import TorchAttention

CPU = torch.device("cpu")


def shared_cache(case: Case, lens: list[int], groups: list[tuple[list[int], int]], gen: torch.Generator):  # type: ignore[no-untyped-def]
    """build_cache, then each group's members point their first `blocks` entries at the first member's."""
    cache = build_cache(case, lens, gen, CPU)
    for members, blocks in groups:
        for m in members[1:]:
            cache.block_tables[m, :blocks] = cache.block_tables[members[0], :blocks]
    return cache


def layout(case: Case, seed: int, q_lens: list[int]) -> tuple[list[int], list[tuple[list[int], int]]]:
    """Context lengths: a group of four sharing p1 blocks, a pair sharing p2, a loner and a short one."""
    bs = case.block_size
    head = -(-MIN_SHARED_TOKENS // bs)
    p1, p2 = head + 3, head + 1
    rng = torch.Generator().manual_seed(seed)
    extra = [int(x) for x in torch.randint(0, 3 * bs, (len(q_lens),), generator=rng)]
    lens = [p1 * bs + q_lens[i] + extra[i] for i in range(4)]
    lens += [p2 * bs + q_lens[i] + extra[i] for i in range(4, 6)]
    lens += [p1 * bs + q_lens[6] + extra[6], 3 + q_lens[7]]
    return lens, [([0, 1, 2, 3], p1), ([4, 5], p2)]


def test_groups_share_the_longest_common_run_of_blocks_within_what_they_see() -> None:
    bs = 16
    tables = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9]]
    # heads of 4 blocks (64 tokens); seq 3 sees only 2 blocks, seq 4's head is its own
    got = shared_prefixes(tables, visible=[6, 6, 6, 2, 5], block_size=bs)
    assert [(g.members, g.num_blocks, g.blocks.tolist()) for g in got] == [([0, 1, 2], 4, [1, 2, 3, 4])]
    got = shared_prefixes(tables[:2], visible=[6, 5], block_size=bs)  # limited by what seq 1 sees
    assert [(g.members, g.num_blocks) for g in got] == [([0, 1], 5)]
    # a member that sees fewer blocks than the head stays out; a lone sequence makes no group
    assert shared_prefixes([*tables[:2], tables[4]], visible=[3, 6, 5], block_size=bs) == []


@pytest.mark.parametrize("case", GRID, ids=str)
def test_decode_over_shared_prefixes_matches_reference(case: Case) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    lens, groups = layout(case, case.seed, [1] * 8)
    cache = shared_cache(case, lens, groups, gen)
    q = random_queries(case, len(lens), gen, CPU)
    scale = 1 / math.sqrt(case.head_dim)
    attn = TorchAttention(native=True)
    if not native_attention.supports(q, cpu_layout(cache.k_cache)):
        pytest.skip("cascade decode runs with the C kernel, which does not take this case here")
    kc, vc = cpu_layout(cache.k_cache), cpu_layout(cache.v_cache)
    got = attn.paged_decode_attention(q, kc, vc, cache.block_tables, cache.context_lens, scale)
    plan = attn._cascade._plan
    assert plan is not None and sorted(g.members for g in plan.groups) == [[0, 1, 2, 3], [4, 5]]
    want = reference.paged_decode_attention(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
    )
    assert_close(got, want, case.dtype)
