"""Admission and batching. Pure Python: owns the block manager, hands the runner typed batches.

Admission rule: a waiting request (in order; the head blocks the rest) is admitted when
    blocks held by running requests + blocks they may still allocate
        + the blocks it newly takes (ceil((prompt + max_new_tokens) / block_size), less the cached
          prefix blocks that running requests already hold) <= pool blocks,
the running count stays <= max_num_seqs, and the prompt tokens it must compute (after its cached
prefix) fit this step's token budget (a single prompt larger than the budget is admitted alone so it
cannot starve). Reserving the worst case means no sequence is ever preempted and the pool never runs
out. A request whose next prompt block another request admitted in this step is about to compute
waits one step, so that it finds that block cached instead of computing it twice.

Admission order: "fcfs" (arrival order) or "longest_first" (largest max_new_tokens first, then arrival).
For batch work longest_first keeps the batch full to the end: long generations start early and short
labeling requests fill the slots they leave, instead of a few long ones decoding alone at the tail.
Results never depend on the order (tests check that batching leaves every output unchanged).

Step policy: prefill first. If any waiting request can be admitted, the step prefills every request
admitted now, packed into one forward pass. Otherwise, if `choices` requests have been prefilled, the
step scores their labels (one packed pass over every label, reading the prompts' blocks in place, up to
the token budget). Otherwise every running sequence that generates decodes one token.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Literal

from worker.engine.block_manager import BlockHash, BlockManager
from worker.engine.config import SchedulePolicy
from worker.engine.sequence import Sequence

Phase = Literal["prefill", "score", "decode"]


@dataclass
class ScheduledBatch:
    phase: Phase
    seqs: list[Sequence]
    block_tables: list[list[int]]  # one per seq, physical block ids


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulePolicy = "fcfs",
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[Sequence] = []  # in admission order
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self._order: dict[str, tuple[int, int]] = {}

    def blocks_needed(self, seq: Sequence) -> int:
        return self.block_manager.blocks_for(seq.max_total_tokens) + seq.scratch_blocks

    def fits_pool_at_all(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.block_manager.num_blocks

    def add(self, seq: Sequence) -> None:
        assert self.fits_pool_at_all(seq), "the engine rejects requests that can never fit"
        seq.status = "waiting"
        n = next(self._arrivals)
        key = (-seq.max_new_tokens if self.policy == "longest_first" else 0, n)
        self._order[seq.request_id] = key
        bisect.insort(self.waiting, seq, key=lambda s: self._order[s.request_id])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        admitted = self._admit()
        if admitted:
            return self._batch("prefill", admitted)
        scoring = self._scoring()
        if scoring:
            return self._batch("score", scoring)
        if self.running:
            for seq in self.running:
                # The last sampled token is not cached yet: this step writes it at position num_tokens - 1.
                self.block_manager.ensure_capacity(seq.request_id, seq.num_tokens)
            return self._batch("decode", list(self.running))
        return None

    def _scoring(self) -> list[Sequence]:
        """Prefilled `choices` requests whose label rows fit this step's budget (the first always goes)."""
        bm = self.block_manager
        picked: list[Sequence] = []
        tokens = 0
        for seq in self.running:
            if seq.labels is None:
                continue
            rows = sum(len(label) for label in seq.labels) + len(seq.labels) * bm.block_size  # upper bound
            if picked and tokens + rows > self.max_num_batched_tokens:
                break
            # Its scratch blocks, reserved at admission, after the prompt's.
            bm.ensure_capacity(
                seq.request_id, (bm.blocks_for(seq.prompt_len) + seq.scratch_blocks) * bm.block_size
            )
            picked.append(seq)
            tokens += rows
        return picked

    def _admit(self) -> list[Sequence]:
        bm = self.block_manager
        admitted: list[Sequence] = []
        tokens = 0
        computing: set[BlockHash] = set()  # prompt blocks this step's prefills compute
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.prompt_hashes is None:
                seq.prompt_hashes = bm.prompt_hashes(seq.prompt_ids)
            hits = bm.match_prefix(seq.prompt_hashes)
            if len(hits) < len(seq.prompt_hashes) and seq.prompt_hashes[len(hits)] in computing:
                break
            need = self.blocks_needed(seq)
            if not bm.can_admit(need, hits):
                break
            cached = len(hits) * bm.block_size
            if admitted and tokens + seq.prompt_len - cached > self.max_num_batched_tokens:
                break
            self.waiting.pop(0)
            del self._order[seq.request_id]
            bm.admit(seq.request_id, need, hits, seq.prompt_hashes)
            bm.ensure_capacity(seq.request_id, seq.prompt_len)
            seq.num_cached_tokens = cached
            seq.status = "running"
            self.running.append(seq)
            admitted.append(seq)
            computing.update(seq.prompt_hashes[len(hits) :])
            tokens += seq.prompt_len - cached
        return admitted

    def _batch(self, phase: Phase, seqs: list[Sequence]) -> ScheduledBatch:
        tables = [self.block_manager.block_table(s.request_id) for s in seqs]
        return ScheduledBatch(phase=phase, seqs=seqs, block_tables=tables)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
            del self._order[seq.request_id]
        seq.status = "finished"
        self.block_manager.release(seq.request_id)
