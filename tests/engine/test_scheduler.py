"""Scheduler: admission, token budget and prompt chunks, mixed steps, max_num_seqs, invariants."""

from __future__ import annotations

import random

import pytest
from fakes import make_seq

from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence


def run_step(sched: Scheduler, token: int = 70) -> tuple[ScheduledBatch, list[Sequence]]:
    """Schedule one step and do what the engine does after the forward pass: advance the prompt chunks,
    append a token to every sequence sampled from (decode rows and prompts completed now)."""
    batch = sched.schedule()
    assert batch is not None
    sampled = batch.seqs[: batch.num_decode] + sched.computed(batch)
    for seq in sampled:
        seq.output_ids.append(token)
    return batch, sampled


def test_admission_reserves_the_worst_case_and_waits_for_room() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, policy="fcfs", admission="reserve")
    a, b, c = make_seq("a", 8, 12), make_seq("b", 4, 12), make_seq("c", 4, 4)  # need 5, 4, 2 blocks
    for s in (a, b, c):
        sched.add(s)
    batch, _ = run_step(sched)
    assert batch.phase == "prefill" and [s.request_id for s in batch.seqs] == ["a", "b"]
    assert bm.num_committed == 9 and bm.num_used == 3  # only the prompts are allocated
    # c (2 blocks) does not fit next to a + b's 9 reserved blocks: FIFO head blocks, decode runs.
    batch, _ = run_step(sched)
    assert batch.phase == "decode"
    sched.finish(a)
    batch, _ = run_step(sched)  # b decodes while c's prompt is computed, in one pass
    assert batch.phase == "mixed" and batch.seqs == [b, c] and batch.num_decode == 1 and batch.chunks == [4]
    bm.check_invariants()


def test_the_token_budget_splits_prompts_into_chunks_and_max_num_seqs_bounds_admission() -> None:
    bm = BlockManager(num_blocks=1000, block_size=16, prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=100, policy="fcfs", admission="reserve")
    seqs = [make_seq(str(i), 40, 4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    first, sampled = run_step(sched)
    assert first.phase == "prefill" and first.chunks == [40, 40, 20]  # 3 x 40 > 100: the third is split
    assert sampled == seqs[:2]  # a prompt chunk that does not end its prompt samples nothing
    # 2 decode rows + the rest of seq 2's prompt; max_num_seqs keeps seqs 3 and 4 waiting
    second, sampled = run_step(sched)
    assert second.phase == "mixed" and second.seqs == seqs[:3] and second.chunks == [20]
    assert sampled == seqs[:3]
    third, _ = run_step(sched)
    assert third.phase == "decode" and third.seqs == seqs[:3]


def test_a_prompt_larger_than_the_budget_is_computed_over_several_steps() -> None:
    bm = BlockManager(100, 16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, policy="fcfs", admission="reserve")
    big, small = make_seq("big", 200, 4), make_seq("small", 4, 4)
    sched.add(big)
    sched.add(small)
    for i in range(6):  # 6 x 32 tokens: the budget is all big's, small waits behind it
        batch, sampled = run_step(sched)
        assert batch.seqs == [big] and batch.chunks == [32] and not sampled
        assert big.num_computed == 32 * (i + 1) and not big.prefilled
        assert bm.num_cached == 2 * (i + 1)  # its full blocks go to the prefix cache as they fill
    batch, sampled = run_step(sched)  # the last 8 tokens of big, and small fits in the rest
    assert batch.phase == "prefill" and batch.seqs == [big, small] and batch.chunks == [8, 4]
    assert sampled == [big, small] and big.prefilled
    assert bm.num_cached == 200 // 16
    batch, _ = run_step(sched)
    assert batch.phase == "decode" and batch.seqs == [big, small]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_workload_keeps_pool_invariants_after_every_step(prefix_caching: bool) -> None:
    rng = random.Random(7)
    bm = BlockManager(num_blocks=40, block_size=4, prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=64, policy="fcfs", admission="reserve")
    pending = [make_seq(str(i), rng.randint(1, 30), rng.randint(1, 20)) for i in range(60)]
    for s in pending:  # shared prefixes of random lengths
        s.prompt_ids = [65 + rng.randint(0, 1)] * rng.randint(0, s.prompt_len) + [90] * s.prompt_len
        s.prompt_ids = s.prompt_ids[: s.prompt_len]
        sched.add(s)
    finished = 0
    while sched.has_work():
        _, sampled = run_step(sched)
        for seq in sampled:
            if len(seq.output_ids) >= seq.max_new_tokens:
                sched.finish(seq)
                finished += 1
        bm.check_invariants()  # the pool is never over-committed
        for seq in sched.running:  # every cached token has a slot
            assert len(bm.block_table(seq.request_id)) * bm.block_size >= seq.num_tokens - 1
    assert finished == 60 and bm.num_free == bm.num_blocks


def test_longest_first_admits_the_longest_generations_first_then_by_arrival() -> None:
    sched = Scheduler(
        BlockManager(1000, 16),
        max_num_seqs=3,
        max_num_batched_tokens=1000,
        policy="longest_first",
        admission="reserve",
    )
    for name, max_new in [("short1", 8), ("long", 200), ("short2", 8), ("mid", 64), ("long2", 200)]:
        sched.add(make_seq(name, 10, max_new))
    batch = sched.schedule()
    assert batch is not None and [s.request_id for s in batch.seqs] == ["long", "long2", "mid"]
    assert [s.request_id for s in sched.waiting] == ["short1", "short2"]
    sched.finish(sched.waiting[0])  # a cancelled waiting request leaves the order intact
    assert [s.request_id for s in sched.waiting] == ["short2"]


def test_requests_sharing_a_prefix_compute_it_once_and_budget_only_their_own_tokens() -> None:
    bm = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=30, policy="fcfs", admission="reserve")
    shared = list(range(100, 120))  # five blocks
    seqs = [make_seq(f"r{i}", 22, 2) for i in range(4)]
    for i, s in enumerate(seqs):
        s.prompt_ids = [*shared, 1, i]
        sched.add(s)
    first, _ = run_step(sched)
    # r1 waits: its first block is being computed by r0 in this very step
    assert [s.request_id for s in first.seqs] == ["r0"]
    second, _ = run_step(sched)
    # r0 decodes; 20 cached tokens each: 2 new tokens apiece fit the rest of the budget of 30 together
    assert second.phase == "mixed" and second.seqs == seqs and second.chunks == [2, 2, 2]
    assert all(s.num_cached_tokens == 20 for s in seqs[1:])
    assert all(bm.block_table(s.request_id)[:5] == bm.block_table("r0")[:5] for s in seqs[1:])
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_optimistic_admission_preempts_the_newest_and_resumes_it_first(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    sched = Scheduler(bm, max_num_seqs=12, max_num_batched_tokens=64, policy="fcfs", admission="optimistic")
    seqs = [make_seq(str(i), rng.randint(1, 20), rng.randint(5, 40) if i < 20 else 40) for i in range(30)]
    # The first 20 stop within 3 tokens (teaching the scheduler a low ratio), the last 10 run long.
    stop_at = {s.request_id: rng.randint(1, 3) if i < 20 else s.max_new_tokens for i, s in enumerate(seqs)}
    for s in seqs:
        s.prompt_ids = [60 + rng.randint(0, 3) for _ in range(s.prompt_len)]
        sched.add(s)
    finished, steps = 0, 0
    while sched.has_work():
        steps += 1
        admitted_before = [s.request_id for s in sched.running]
        preempted_before = sched.preemptions
        batch, sampled = run_step(sched, token=61)
        if sched.preemptions > preempted_before:  # the victims were the newest, now first in line
            gone = [rid for rid in admitted_before if rid not in {s.request_id for s in sched.running}]
            assert gone == admitted_before[len(admitted_before) - len(gone) :]
            resumed = [s.preemptions > 0 for s in sched.waiting]
            assert resumed == sorted(resumed, reverse=True) and resumed[0]
        for seq in batch.seqs:
            assert len(bm.block_table(seq.request_id)) * bm.block_size >= seq.num_tokens - 1
        for seq in sampled:
            if len(seq.output_ids) >= stop_at[seq.request_id]:
                seq.finish_reason = "stop"
                sched.finish(seq)
                finished += 1
        bm.check_invariants()
    assert finished == 30 and bm.num_free == bm.num_blocks
    assert sched.preemptions > 0, "the pool never ran out: make it smaller"
    assert all(len(s.output_ids) == stop_at[s.request_id] for s in seqs)  # no token lost or added on resume
