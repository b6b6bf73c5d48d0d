"""The block manager and scheduler under a sliding window (every layer windowed): blocks wholly before the
next token's window go back to the pool as a sequence advances, never one a layer still reads; admission
counts what a sequence holds at once; prefix hits need only the blocks the window reaches. Pure Python."""

from __future__ import annotations

import random

import pytest
from fakes import make_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.block_manager import BlockManager
from worker.engine.kv_window import SlidingWindow
from worker.engine.scheduler import RELEASED_BLOCK, Scheduler
from worker.engine.sequence import Sequence


def windowed(num_blocks: int, block_size: int, window: int, max_chunk: int, **kw: object) -> BlockManager:
    return BlockManager(num_blocks, block_size, window=SlidingWindow(window, max_chunk), **kw)  # type: ignore[arg-type]


def run_to_end(sched: Scheduler, token: int = 70) -> int:
    """Step until every sequence has generated its max_new_tokens, checking the invariants after each step.
    -> the most sequences that ran at once."""
    peak = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        for seq, table, released in zip(batch.seqs, batch.block_tables, batch.released, strict=True):
            assert table[:released] == [RELEASED_BLOCK] * released
            assert table[released:] == sched.block_manager.block_table(seq.request_id)
        peak = max(peak, len(sched.running))
        for seq in batch.seqs[: batch.num_decode] + sched.computed(batch):
            seq.output_ids.append(token)
            if len(seq.output_ids) >= seq.max_new_tokens:
                seq.finish_reason = "length"
                sched.finish(seq)
        sched.check_invariants()
    return peak


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("max_chunk", [1, 4, 23])
def test_held_blocks_is_the_most_blocks_a_chunk_and_its_window_span(
    block_size: int, window: int, max_chunk: int
) -> None:
    """Every chunk start and size up to max_chunk: the blocks from its first query's window start to its
    last token never exceed held_blocks, and some chunk reaches it."""
    spans = []
    for start in range(0, 4 * (window + max_chunk + block_size)):
        for n in range(1, max_chunk + 1):
            first = max(0, start - window + 1) // block_size
            spans.append((start + n - 1) // block_size - first + 1)
    assert max(spans) == SlidingWindow(window, max_chunk).held_blocks(block_size)


def test_sliding_releases_blocks_behind_the_window_and_keeps_their_registration() -> None:
    bm = windowed(20, 4, window=6, max_chunk=4)
    prompt = list(range(10, 30))  # 20 tokens: five blocks
    hashes = bm.prompt_hashes(prompt)
    bm.admit("a", bm.held_bound(30), [], hashes)
    for start in range(0, 20, 4):  # chunk by chunk, as the scheduler does
        bm.slide("a", start)
        bm.ensure_capacity("a", start + 4)
        bm.cache_computed("a", prompt, [], start + 4)
        bm.check_invariants()
    # the next token, at 20, reads from 15 on: blocks 0-2 (tokens 0-11) are behind every window
    assert bm.slide("a", 20) == 1 and bm.released("a") == 3 and bm.window_released == 3
    assert len(bm.block_table("a")) == 2 and bm.num_used == 2
    assert bm.num_cached == 5  # released blocks keep their K/V and registration in the free queue
    assert bm.num_committed == bm.held_bound(30)  # the reservation stays: its next blocks count against it
    bm.check_invariants()
    # a prompt sharing all five blocks hits: the ones its window reaches, taken back from the free queue
    hit = bm.match_prefix(bm.prompt_hashes([*prompt, 99]))
    assert (hit.first, hit.end) == (3, 5) and hit.blocks == bm.block_table("a")
    bm.release("a")
    assert bm.num_free == 20
    bm.check_invariants()


def test_a_prefix_hit_needs_only_the_blocks_its_window_reaches() -> None:
    """A long cached prefix whose first blocks were evicted (a windowed sequence frees them first) still
    hits: the token after it reads only the last block."""
    bm = windowed(12, 4, window=5, max_chunk=4)
    prompt = list(range(40, 72))  # eight blocks of 4
    hashes = bm.prompt_hashes([*prompt, 1])
    bm.admit("a", bm.held_bound(40), [], hashes)
    for start in range(0, 32, 4):
        bm.slide("a", start)
        bm.ensure_capacity("a", start + 4)
        bm.cache_computed("a", prompt, [], start + 4)
    assert bm.released("a") == 6 and bm.num_cached == 8
    bm.admit("other", 6, [], [])  # the four never-used blocks, then the least recently freed: a's first two
    bm.ensure_capacity("other", 24)
    assert bm.evicted_blocks == 2 and bm.num_cached == 6
    hit = bm.match_prefix(hashes)
    assert (hit.first, hit.end) == (7, 8) and hit.blocks == bm.block_table("a")[1:]
    bm.check_invariants()


def test_admission_counts_what_a_windowed_sequence_holds_at_once() -> None:
    """Under "reserve", each of three requests of 200 tokens would need 13 blocks of 16 without the window;
    with a window of 32 and chunks of 16 each holds at most 4 at once, and all three run in a pool of 12."""
    for window, admitted in ((None, 0), (32, 3)):
        bm = BlockManager(12, 16) if window is None else windowed(12, 16, window, max_chunk=16)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, policy="fcfs", admission="reserve")
        seqs = [make_seq(f"s{i}", 40, 160) for i in range(3)]
        assert [sched.blocks_needed(s) for s in seqs] == [13 if window is None else 4] * 3
        if window is None:
            assert not any(sched.fits_pool_at_all(s) for s in seqs)
            continue
        for s in seqs:
            sched.add(s)
        assert run_to_end(sched) == admitted  # together: each waits for the token budget, not for blocks
        assert bm.window_released > 3 * 8 and bm.num_free == 12


def test_labels_do_not_slide() -> None:
    """A choices request's score step rereads its prompt's last full blocks: it keeps all of them."""
    bm = windowed(40, 4, window=4, max_chunk=8)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, policy="fcfs", admission="reserve")
    seq = make_seq("c", 30, 1)
    seq.labels, seq.scratch_blocks, seq.max_new_tokens = [[5, 6]], 1, 0  # as PromptBuilder makes one
    sched.add(seq)
    while not seq.prefilled:
        batch = sched.schedule()
        assert batch is not None
        sched.computed(batch)
        sched.check_invariants()
    assert bm.released("c") == 0 and len(bm.block_table("c")) == 8


@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
@pytest.mark.parametrize("seed", range(3))
def test_random_windowed_workloads_keep_every_invariant(admission: str, seed: int) -> None:
    """Prompts longer than the pool and the budget, shared prefixes, preemptions (optimistic): after every
    step the pool is consistent, no block a sequence's next token reads was released, and every sequence
    ends with all its tokens."""
    rng = random.Random(seed)
    bm = windowed(14, 4, window=rng.choice([3, 8, 11]), max_chunk=12)
    sched = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=12, policy="fcfs", admission=admission)  # type: ignore[arg-type]
    shared = [rng.randint(3, 9) for _ in range(30)]
    seqs: list[Sequence] = []
    for i in range(25):
        s = make_seq(str(i), rng.randint(1, 80), rng.randint(1, 60))
        s.prompt_ids = (shared[: rng.randint(0, 30)] + [rng.randint(3, 9) for _ in range(s.prompt_len)])[
            : s.prompt_len
        ]
        if sched.fits_pool_at_all(s):
            sched.add(s)
            seqs.append(s)
    assert len(seqs) == 25  # the longest is 140 tokens: 35 blocks, in a pool of 14
    run_to_end(sched)
    assert all(len(s.output_ids) == s.max_new_tokens for s in seqs)
    assert bm.num_free == bm.num_blocks and bm.window_released > 0


op = st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.just("advance"), st.integers(0, 20), st.integers(1, 6)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 5),
    window=st.integers(1, 12),
    max_chunk=st.integers(1, 6),
    ops=st.lists(op, max_size=50),
)
def test_any_windowed_sequence_of_operations_keeps_the_pool_consistent(
    block_size: int, window: int, max_chunk: int, ops: list[tuple[object, ...]]
) -> None:
    """Random admissions, chunks (prompt or decode) and finishes: reservations hold every chunk, a slide
    never releases a block at or after the window's first, and the pool's identities hold throughout."""
    num_blocks = 24
    bm = windowed(num_blocks, block_size, window, max_chunk)
    live: dict[str, tuple[list[int], int]] = {}  # id -> tokens so far, tokens in all
    counter = 0
    for o in ops:
        if o[0] == "admit":
            _, prompt_len, max_new = o
            total = int(prompt_len) + int(max_new)  # type: ignore[call-overload]
            tokens = [counter % 3 + 1] * int(prompt_len)  # type: ignore[call-overload]
            hashes = bm.prompt_hashes(tokens)
            hit = bm.match_prefix(hashes)
            need = bm.held_bound(total)
            if need > num_blocks or not bm.can_admit(need, hit.blocks):
                continue
            sid = f"s{counter}"
            counter += 1
            bm.admit(sid, need, hit.blocks, hashes, hit.first)
            live[sid] = (tokens[: hit.end * block_size], total)
        elif o[0] == "advance" and live:
            sid = sorted(live)[int(o[1]) % len(live)]  # type: ignore[call-overload]
            done, total = live[sid]
            n = min(int(o[2]), max_chunk, total - len(done))  # type: ignore[call-overload]
            if n <= 0:
                continue
            start = len(done)
            bm.slide(sid, start)
            assert bm.released(sid) <= max(0, start - window + 1) // block_size
            bm.ensure_capacity(sid, start + n)
            done.extend([7] * n)
            bm.cache_computed(sid, done, [], len(done))
        elif o[0] == "finish" and live:
            sid = sorted(live)[int(o[1]) % len(live)]  # type: ignore[call-overload]
            bm.release(sid)
            del live[sid]
        bm.check_invariants()
    for sid in list(live):
        bm.release(sid)
    bm.check_invariants()
    assert bm.num_free == num_blocks and bm.num_committed == 0
