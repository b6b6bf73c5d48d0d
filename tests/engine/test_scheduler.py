"""Scheduler: worst-case admission, token budget, max_num_seqs, prefill-first policy, invariants."""

from __future__ import annotations

import random

import pytest
from fakes import make_seq

from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler


def test_admission_reserves_the_worst_case_and_waits_for_room() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = make_seq("a", 8, 12), make_seq("b", 4, 12), make_seq("c", 4, 4)  # need 5, 4, 2 blocks
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch is not None and batch.phase == "prefill" and [s.request_id for s in batch.seqs] == ["a", "b"]
    assert bm.num_committed == 9 and bm.num_used == 3  # only the prompts are allocated
    # c (2 blocks) does not fit next to a + b's 9 reserved blocks: FIFO head blocks, decode runs.
    batch = sched.schedule()
    assert batch is not None and batch.phase == "decode"
    sched.finish(a)
    batch = sched.schedule()
    assert batch is not None and batch.phase == "prefill" and batch.seqs == [c]
    bm.check_invariants()


def test_token_budget_and_max_num_seqs_bound_a_prefill() -> None:
    bm = BlockManager(num_blocks=1000, block_size=16, prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=100)
    seqs = [make_seq(str(i), 40, 4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first is not None and [s.prompt_len for s in first.seqs] == [40, 40]  # 3 x 40 > 100
    second = sched.schedule()
    assert second is not None and second.phase == "prefill" and len(second.seqs) == 1  # max_num_seqs
    third = sched.schedule()
    assert third is not None and third.phase == "decode" and len(third.seqs) == 3


def test_a_prompt_larger_than_the_budget_is_admitted_alone() -> None:
    sched = Scheduler(BlockManager(100, 16), max_num_seqs=4, max_num_batched_tokens=32)
    sched.add(make_seq("big", 200, 4))
    sched.add(make_seq("small", 4, 4))
    batch = sched.schedule()
    assert batch is not None and [s.request_id for s in batch.seqs] == ["big"]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_workload_keeps_pool_invariants_after_every_step(prefix_caching: bool) -> None:
    rng = random.Random(7)
    bm = BlockManager(num_blocks=40, block_size=4, prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=64)
    pending = [make_seq(str(i), rng.randint(1, 30), rng.randint(1, 20)) for i in range(60)]
    for s in pending:  # shared prefixes of random lengths
        s.prompt_ids = [65 + rng.randint(0, 1)] * rng.randint(0, s.prompt_len) + [90] * s.prompt_len
        s.prompt_ids = s.prompt_ids[: s.prompt_len]
        sched.add(s)
    finished = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        for seq in batch.seqs:
            bm.cache_computed(seq.request_id, seq.prompt_ids, seq.output_ids, seq.num_tokens)
            seq.output_ids.append(70)  # what the engine does with a sampled token
            if len(seq.output_ids) >= seq.max_new_tokens:
                sched.finish(seq)
                finished += 1
        bm.check_invariants()  # the pool is never over-committed
        for seq in sched.running:  # every cached token has a slot
            assert len(bm.block_table(seq.request_id)) * bm.block_size >= seq.num_tokens - 1
    assert finished == 60 and bm.num_free == bm.num_blocks


def test_longest_first_admits_the_longest_generations_first_then_by_arrival() -> None:
    sched = Scheduler(
        BlockManager(1000, 16), max_num_seqs=3, max_num_batched_tokens=1000, policy="longest_first"
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
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=30)
    shared = list(range(100, 120))  # five blocks
    seqs = [make_seq(f"r{i}", 22, 2) for i in range(4)]
    for i, s in enumerate(seqs):
        s.prompt_ids = [*shared, 1, i]
        sched.add(s)
    first = sched.schedule()
    # r1 waits: its first block is being computed by r0 in this very step
    assert first is not None and [s.request_id for s in first.seqs] == ["r0"]
    for s in first.seqs:
        bm.cache_computed(s.request_id, s.prompt_ids, s.output_ids, s.num_tokens)
        s.output_ids.append(5)
    second = sched.schedule()
    # 20 cached tokens each: 2 new tokens apiece fit the budget of 30 together
    assert second is not None and second.phase == "prefill" and len(second.seqs) == 3
    assert all(s.num_cached_tokens == 20 for s in second.seqs)
    assert all(bm.block_table(s.request_id)[:5] == bm.block_table("r0")[:5] for s in second.seqs)
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_optimistic_admission_preempts_the_newest_and_resumes_it_first(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    sched = Scheduler(bm, max_num_seqs=12, max_num_batched_tokens=64, admission="optimistic")
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
        batch = sched.schedule()
        assert batch is not None
        if sched.preemptions > preempted_before:  # the victims were the newest, now first in line
            gone = [rid for rid in admitted_before if rid not in {s.request_id for s in sched.running}]
            assert gone == admitted_before[len(admitted_before) - len(gone) :]
            resumed = [s.preemptions > 0 for s in sched.waiting]
            assert resumed == sorted(resumed, reverse=True) and resumed[0]
        for seq in batch.seqs:
            assert len(bm.block_table(seq.request_id)) * bm.block_size >= len(seq.prefill_ids)
            bm.cache_computed(seq.request_id, seq.prompt_ids, seq.output_ids, seq.num_tokens)
            seq.output_ids.append(61)
            if len(seq.output_ids) >= stop_at[seq.request_id]:
                seq.finish_reason = "stop"
                sched.finish(seq)
                finished += 1
        bm.check_invariants()
    assert finished == 30 and bm.num_free == bm.num_blocks
    assert sched.preemptions > 0, "the pool never ran out: make it smaller"
    assert all(len(s.output_ids) == stop_at[s.request_id] for s in seqs)  # no token lost or added on resume
