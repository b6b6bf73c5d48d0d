"""Block manager: reservations, lazy allocation, release, prefix-cache sharing and eviction, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.block_manager import BlockManager


def admit(bm: BlockManager, seq_id: str, prompt: list[int], max_new: int) -> int:
    """What the scheduler does: match the cached prefix, admit, allocate the prompt. -> cached tokens."""
    hashes = bm.prompt_hashes(prompt)
    hits = bm.match_prefix(hashes).blocks
    need = bm.blocks_for(len(prompt) + max_new)
    assert bm.can_admit(need, hits)
    bm.admit(seq_id, need, hits, hashes)
    bm.ensure_capacity(seq_id, len(prompt))
    return len(hits) * bm.block_size


def test_blocks_are_allocated_lazily_within_the_reservation() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.admit("a", 3, [], [])
    bm.ensure_capacity("a", 5)
    assert len(bm.block_table("a")) == 2 and bm.num_used == 2 and bm.num_committed == 3
    bm.ensure_capacity("a", 12)
    assert len(bm.block_table("a")) == 3
    with pytest.raises(AssertionError):
        bm.ensure_capacity("a", 13)  # past the reservation
    bm.check_invariants()


def test_reservations_never_exceed_the_pool_and_release_returns_everything() -> None:
    bm = BlockManager(num_blocks=5, block_size=16)
    bm.admit("a", 3, [], [])
    assert bm.can_admit(2, []) and not bm.can_admit(3, [])
    bm.admit("b", 2, [], [])
    bm.ensure_capacity("a", 40)
    bm.ensure_capacity("b", 17)
    assert bm.num_free == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.release("a")
    bm.check_invariants()
    assert bm.num_free == 3 and bm.can_admit(3, [])
    bm.release("b")
    bm.release("never-admitted")  # a no-op
    assert bm.num_free == 5 and bm.num_committed == 0
    bm.check_invariants()


def test_blocks_for_rounds_up() -> None:
    bm = BlockManager(num_blocks=1, block_size=16)
    assert [bm.blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_a_shared_prefix_is_computed_once_and_shared_by_reference() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    prefix = list(range(100, 112))  # three full blocks
    a = [*prefix, 1, 2]
    assert admit(bm, "a", a, 4) == 0
    bm.cache_computed("a", a, [], len(a))  # a's prefill wrote its K/V
    assert bm.num_cached == 3  # the partial last block is not registered
    b = [*prefix, 7, 8, 9]
    assert admit(bm, "b", b, 4) == 12  # all three prefix blocks hit
    assert bm.block_table("b")[:3] == bm.block_table("a")[:3]
    # b newly took only its own blocks: ceil((15 + 4) / 4) = 5, less 3 shared = 2
    assert bm.num_committed == bm.blocks_for(len(a) + 4) + 2
    bm.check_invariants()
    bm.release("a")
    assert bm.block_table("b")[0] not in range(0)  # still held by b
    bm.check_invariants()


def test_the_last_prompt_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    p = list(range(8))  # exactly two blocks
    admit(bm, "a", p, 2)
    bm.cache_computed("a", p, [], 8)
    assert bm.num_cached == 2
    assert admit(bm, "b", p, 2) == 4  # the block ending the prompt is computed again for its logits


def test_freed_cached_blocks_survive_until_the_pool_needs_them_then_lru_goes_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    for sid, p in (("old", old), ("new", new)):
        admit(bm, sid, p, 1)
        bm.cache_computed(sid, p, [], len(p))
        bm.release(sid)
    assert bm.num_cached == 4 and bm.num_free == 6
    assert admit(bm, "again", [*new, 1], 1) == 4  # new's blocks are still cached
    bm.release("again")
    # A long uncached prompt needs every block: uncached ones go first, then least recently freed.
    admit(bm, "big", [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 1)
    assert bm.num_cached == 0 and bm.evicted_blocks == 4
    bm.check_invariants()


def test_equal_prompts_computed_in_one_step_register_one_copy() -> None:
    bm = BlockManager(num_blocks=10, block_size=2)
    p = [1, 2, 3]
    admit(bm, "a", p, 1)
    admit(bm, "b", p, 1)  # admitted before a's prefill ran: no hit
    bm.cache_computed("a", p, [], 3)
    bm.cache_computed("b", p, [], 3)
    assert bm.num_cached == 1
    bm.check_invariants()


def test_output_blocks_are_cached_as_they_fill() -> None:
    bm = BlockManager(num_blocks=10, block_size=2)
    p = [1, 2, 3]
    admit(bm, "a", p, 4)
    bm.cache_computed("a", p, [], 3)
    bm.ensure_capacity("a", 4)
    bm.cache_computed("a", p, [4], 4)  # the decode step wrote token 4's K/V: block [3, 4] is full
    assert bm.num_cached == 2
    assert admit(bm, "b", [1, 2, 3, 4, 5], 1) == 4


def test_switched_off_it_caches_nothing() -> None:
    bm = BlockManager(num_blocks=10, block_size=2, prefix_caching=False)
    p = [1, 2, 3, 4, 5]
    admit(bm, "a", p, 1)
    bm.cache_computed("a", p, [], 5)
    assert bm.num_cached == 0 and admit(bm, "b", p, 1) == 0


def test_salt_separates_caches() -> None:
    a, b = BlockManager(4, 2, salt=b"model-a"), BlockManager(4, 2, salt=b"model-b")
    assert a.prompt_hashes([1, 2, 3]) != b.prompt_hashes([1, 2, 3])


# ---- property: random admit / grow / finish sequences keep every invariant --------------------------

PREFIXES = [[], [7] * 5, [7, 7, 7, 7, 8, 8, 8, 8], list(range(20, 33))]

op = st.one_of(
    st.tuples(
        st.just("admit"),
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(1, 6), max_size=9),
        st.integers(1, 9),
    ),
    st.tuples(st.just("grow"), st.integers(0, 20), st.integers(1, 4)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(4, 24), block_size=st.integers(1, 4), ops=st.lists(op, max_size=60))
def test_any_sequence_of_operations_keeps_the_pool_consistent(
    num_blocks: int, block_size: int, ops: list[tuple[object, ...]]
) -> None:
    bm = BlockManager(num_blocks, block_size)
    live: dict[str, tuple[list[int], list[int], int]] = {}  # id -> prompt, output, reservation in tokens
    counter = 0
    for o in ops:
        if o[0] == "admit":
            _, pi, tail, max_new = o
            prompt = PREFIXES[pi] + list(tail) or [1]  # type: ignore[operator]
            hashes = bm.prompt_hashes(prompt)
            hits = bm.match_prefix(hashes).blocks
            need = bm.blocks_for(len(prompt) + max_new)  # type: ignore[operator]
            held_before = {b for sid in live for b in bm.block_table(sid)}
            if need > num_blocks or not bm.can_admit(need, hits):
                continue
            sid = f"s{counter}"
            counter += 1
            cached_before = {h for h in hashes if bm.match_prefix([h]).blocks}
            bm.admit(sid, need, hits, hashes)
            bm.ensure_capacity(sid, len(prompt))
            # eviction never takes a block a sequence holds
            assert held_before <= {b for s in [*live, sid] for b in bm.block_table(s)}
            assert len(cached_before) >= len(hits)
            bm.cache_computed(sid, prompt, [], len(prompt))
            live[sid] = (prompt, [], len(prompt) + max_new)  # type: ignore[operator]
        elif o[0] == "grow" and live:
            sid = sorted(live)[o[1] % len(live)]  # type: ignore[operator]
            prompt, out, cap = live[sid]
            for _ in range(o[2]):  # type: ignore[misc]
                n = len(prompt) + len(out)
                if n >= cap:
                    break
                bm.ensure_capacity(sid, n + 1)
                out.append(len(out) % 3)
                bm.cache_computed(sid, prompt, out, n)  # the token before the new one is computed
        elif o[0] == "finish" and live:
            sid = sorted(live)[o[1] % len(live)]  # type: ignore[operator]
            bm.release(sid)
            del live[sid]
        bm.check_invariants()
    for sid in list(live):
        bm.release(sid)
    bm.check_invariants()
    assert bm.num_free == num_blocks and bm.num_committed == 0
