"""Block manager: reservations, lazy allocation, release, and the pool invariants."""

from __future__ import annotations

import pytest

from worker.engine.block_manager import BlockManager


def test_blocks_are_allocated_lazily_within_the_reservation() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.reserve("a", 3)
    bm.ensure_capacity("a", 5)
    assert len(bm.block_table("a")) == 2 and bm.num_used == 2 and bm.num_reserved == 3
    bm.ensure_capacity("a", 12)
    assert len(bm.block_table("a")) == 3
    with pytest.raises(AssertionError):
        bm.ensure_capacity("a", 13)  # past the reservation
    bm.check_invariants()


def test_reservations_never_exceed_the_pool_and_release_returns_everything() -> None:
    bm = BlockManager(num_blocks=5, block_size=16)
    bm.reserve("a", 3)
    assert bm.can_reserve(2) and not bm.can_reserve(3)
    bm.reserve("b", 2)
    bm.ensure_capacity("a", 40)
    bm.ensure_capacity("b", 17)
    assert bm.num_free == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.release("a")
    bm.check_invariants()
    assert bm.num_free == 3 and bm.can_reserve(3)
    bm.release("b")
    bm.release("never-admitted")  # a no-op
    assert bm.num_free == 5 and bm.num_reserved == 0
    bm.check_invariants()


def test_blocks_for_rounds_up() -> None:
    bm = BlockManager(num_blocks=1, block_size=16)
    assert [bm.blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
