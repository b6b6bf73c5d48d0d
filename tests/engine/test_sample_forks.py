"""Forked samples in the scheduler and block manager (n > 1), pure Python: a leader's samples fork when its
prompt is computed, share its full blocks and own a partial one, and every pool invariant holds after each
step, with and without a sliding window, under both admission rules, preemptions included."""

from __future__ import annotations

import random

import pytest
from fakes import CharTokenizer, make_seq

from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.kv_window import SlidingWindow
from worker.engine.samples import fork_samples
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence


def group(rid: str, prompt_len: int, max_new: int, n: int) -> Sequence:
    leader = make_seq(rid, prompt_len, max_new, n=n)
    fork_samples(leader, lambda: IncrementalDetokenizer(CharTokenizer()), lambda: None)
    return leader


def run(sched: Scheduler, seqs: list[Sequence]) -> dict[str, list[int]]:
    """Step to the end as the engine does (fork after computed), a token per sampled row. -> each
    sequence's first table, as it started decoding."""
    for s in seqs:
        assert sched.fits_pool_at_all(s)
        sched.add(s)
    first: dict[str, list[int]] = {}
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        done = sched.computed(batch)
        copies = sched.fork(batch)
        bm = sched.block_manager
        for leader in done:
            forks = [f for i, f in batch.forks if batch.seqs[i] is leader]
            for s in (leader, *forks):
                first.setdefault(s.request_id, list(bm.block_table(s.request_id)))
        if batch.forks and bm.window is None:
            assert len(copies) == sum(f.prompt_len % bm.block_size != 0 for _, f in batch.forks)
        for seq in [*batch.seqs[: batch.num_decode], *done, *(f for _, f in batch.forks)]:
            seq.output_ids.append(70)
            if len(seq.output_ids) >= seq.max_new_tokens:
                seq.finish_reason = "length"
                sched.finish(seq)
        sched.check_invariants()
        assert sum(1 + len(s.forks) for s in sched.running) <= sched.max_num_seqs
    assert sched.block_manager.num_free == sched.block_manager.num_blocks
    return first


@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seed", range(4))
def test_samples_fork_share_and_free_every_block(admission: str, window: int | None, seed: int) -> None:
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(48, bs, window=SlidingWindow(window, 8) if window else None)
    sched = Scheduler(bm, 8, 8, policy="fcfs", admission=admission)  # type: ignore[arg-type]
    seqs = [group(f"g{i}", rng.randint(1, 14), rng.randint(1, 12), rng.randint(1, 4)) for i in range(10)]
    first = run(sched, seqs)
    assert not any(leader.forks for leader in seqs), "a sample never forked"
    if window is None:
        for s in seqs:
            samples = [k for k in first if k.split("\x1f")[0] == s.request_id]
            full = s.prompt_len // bs
            tables = [first[k] for k in samples]
            if s.preemptions == 0 and all(len(t) >= full for t in tables):
                assert len({tuple(t[:full]) for t in tables}) == 1, "the full prompt blocks are not shared"
                if s.prompt_len % bs:
                    assert len({t[full] for t in tables}) == len(tables), "a partial block is shared"
    if admission == "reserve":
        assert sched.preemptions == 0


def test_a_tiny_pool_preempts_samples_and_still_ends_every_one() -> None:
    bm = BlockManager(16, 2)  # a group's worst case is 11 blocks: two run at once, expected to fit
    sched = Scheduler(bm, 8, 16, policy="fcfs", admission="optimistic")
    seqs = [group(f"g{i}", 3 + 2 * (i // 2), 8, 2) for i in range(4)]
    run(sched, seqs)
    assert sched.preemptions > 0
