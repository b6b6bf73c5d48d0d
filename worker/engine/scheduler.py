"""Admission and batching. Pure Python: owns the block manager, hands the runner typed batches.

Two admission rules (EngineConfig.admission); under both, a waiting request (in order; the head blocks
the rest) is admitted only while the running count stays <= max_num_seqs and some of this step's token
budget is left (its prompt, after the cached prefix, is computed in chunks of what is left, over as many
steps as it takes).

- "reserve": blocks held by running requests + blocks they may still allocate + the blocks it newly
  takes (ceil((prompt + max_new_tokens) / block_size), less the cached prefix blocks that running
  requests already hold) <= pool blocks. The worst case is reserved, so nothing is ever preempted.
- "optimistic" (the default): the same sum, but with each sequence's future growth estimated as
  new_token_ratio x its remaining max_new_tokens instead of all of it. Most requests stop long before
  max_new_tokens (a label after a few tokens), so the pool holds several times more sequences. The
  ratio is measured: 1.5 x the running mean (weight 0.1) of generated / max_new_tokens over finished
  requests, kept within [0.1, 1]; it starts at 0.7 and goes back to at least 0.7 at every preemption
  (SGLang decays a fixed ratio per step instead; a measured one follows the workload, and a labeling
  batch that stops at 2 of 16 tokens packs the pool within a few dozen requests). When a decode step
  needs a block the pool no longer has, the most recently admitted
  sequence is preempted: its blocks go back (its full blocks stay in the prefix cache), it goes to the
  head of the queue, and it resumes later by prefilling its prompt and the tokens it had generated.
  Its next token is then sampled from the same position with the same RNG counter, so a preempted
  request produces the same tokens as one never preempted.

A request whose next prompt block another request admitted in this step is about to compute waits one
step, so that it finds that block cached instead of computing it twice.

Sliding windows (a block manager with a window: every layer of the model has one): a generating sequence
slides (block_manager.slide) before each of its chunks and decode steps, releasing the blocks its next
token's window no longer reaches, and allocates its prompt chunk by chunk rather than whole at admission, so
its worst case is what it holds at once (block_manager.held_bound), not prompt + max_new_tokens: that is
what both admission rules count for it. A `choices` request does not slide: its score step rereads the
prompt's last full blocks.

Embedding inputs (Sequence.pooling) are prefill-only: admitted and chunked like any prompt, with no
growth; the engine ends each in the step that computes its last token. One pooled by the mean takes no
prefix hit (its every token's hidden state is needed); its blocks are still offered to the cache.

Admission order: "fcfs" (arrival order) or "longest_first" (largest max_new_tokens first, then arrival).
For batch work longest_first keeps the batch full to the end: long generations start early and short
labeling requests fill the slots they leave, instead of a few long ones decoding alone at the tail.
Results never depend on the order (tests check that batching leaves every output unchanged).

Step policy (mixed steps, chunked prefill, as in vLLM v1 and Sarathi-Serve): if `choices` requests have
been prefilled, the step scores their labels (one packed pass over every label, reading the prompts'
blocks in place, up to the token budget). Otherwise every prefilled sequence decodes one token, and
what is left of max_num_batched_tokens goes to prompt chunks, prefills in progress first, then new
admissions, all in the same forward pass. Decoding never stalls behind a long prefill, and a prompt
larger than the budget is computed a chunk per step.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections import abc
from dataclasses import dataclass, field
from typing import Literal, Protocol, overload

from worker.engine.block_manager import BlockHash, BlockManager, TableRows
from worker.engine.kv_window import PrefixHit
from worker.engine.sequence import Sequence
from worker.engine_config import Admission, SchedulePolicy

_FORKS = operator.attrgetter("forks")  # a step's seat count reads every running sequence's: in C
_REQUEST_ID = operator.attrgetter("request_id")

Phase = Literal["prefill", "mixed", "decode", "score"]
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, RATIO_MARGIN, RATIO_WEIGHT = 0.7, 0.1, 1.5, 0.1
RESUME_FIRST = -(1 << 62)  # the order key of a preempted sequence: ahead of every other waiting one
REFUSAL_STEPS = 16  # admission_closed: steps a head the pool refused waits before it is tried again


# What a block table names in place of a block the window released: block 0, like a table's padding. No
# kernel reads it: every layer's window begins after it.
RELEASED_BLOCK = 0


Tables = abc.Sequence[list[int]]  # a batch's block tables: lists, or BlockTables


class BlockTables(abc.Sequence[list[int]]):
    """A batch's block tables (ScheduledBatch.block_tables), made as they are read: the physical block of each
    logical block of each sequence, RELEASED_BLOCK for those the window released. A decode step reads the
    block manager's table rows (TableRows) instead, and never makes them."""

    def __init__(self, bm: BlockManager, ids: list[str], released: list[int]) -> None:
        self._bm, self._ids, self._released = bm, ids, released

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> list[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...
    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._ids)))]
        return [RELEASED_BLOCK] * self._released[i] + self._bm.block_table(self._ids[i])


@dataclass
class ScheduledBatch:
    phase: Phase
    seqs: list[Sequence]  # the decoding ones first, then the ones computing a prompt chunk
    # One per seq: the physical block of each logical block, RELEASED_BLOCK for those the window released
    block_tables: Tables
    num_decode: int = 0  # seqs[:num_decode] decode one token each
    chunks: list[int] = field(default_factory=list)  # seqs[num_decode:]: prompt tokens computed this step
    # n > 1: (index in seqs of a leader whose chunk completes its prompt, a sample to fork from it); the
    # sample's first token comes from the leader's logits row of this step
    forks: list[tuple[int, Sequence]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # per seq: leading logical blocks released
    # The same tables as rows of the block manager's buffer (TableRows): each seq's row there. A batch built by
    # hand has none; the runner then pads block_tables.
    rows: list[int] | None = None
    table_rows: TableRows | None = None

    def chunk_lens(self) -> list[int]:
        """The prompt tokens each sequence after the decoding ones computes this step: `chunks`, or, in a
        batch built by hand without them, all that each has left."""
        nd = self.num_decode if self.phase != "prefill" else 0
        return self.chunks or [len(s.prefill_ids) - s.num_computed for s in self.seqs[nd:]]


class AdapterSlots(Protocol):
    """The LoRA adapters' slots (engine/lora.py): a running sequence of an adapter holds its slot."""

    def acquire(self, name: str) -> int | None: ...  # its slot, held once more; None: every slot is held
    def hold(self, slot: int) -> None: ...
    def release(self, slot: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        policy: SchedulePolicy,
        admission: Admission,
    ) -> None:
        """Every setting comes from the caller (the engine passes EngineConfig's, where the defaults live)."""
        self.block_manager = block_manager
        self.admission = admission
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._used = INIT_NEW_TOKEN_RATIO / RATIO_MARGIN  # running mean of generated / max_new_tokens
        self.preemptions = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[Sequence] = []  # in admission order
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        # the waiting head the pool last refused (admission_closed), and the steps since
        self._refused: Sequence | None = None
        self._refused_steps = 0
        self._order: dict[str, tuple[int, int]] = {}
        self.loras: AdapterSlots | None = None  # where the engine serves LoRA adapters

    def slides(self, seq: Sequence) -> bool:
        """Whether the window releases this sequence's early blocks as it advances (a windowed model's
        generating sequence; a `choices` request's score step rereads its prompt's blocks)."""
        return self.block_manager.window is not None and not seq.scores_labels

    def blocks_needed(self, seq: Sequence) -> int:
        """Its worst case: the most blocks it holds at once (and a choices request's scratch blocks), and
        what the samples to fork from it take beyond the prompt blocks they share."""
        own = self._held(seq, seq.max_total_tokens) + seq.scratch_blocks
        return own + len(seq.forks) * self._fork_blocks(seq, seq.max_total_tokens)

    def _fork_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks one sample forked from `seq` takes of its own once it holds num_tokens tokens: all past
        the prompt's full blocks (under a window, all it holds: shared blocks earn no credit there)."""
        if self.block_manager.window is not None:
            return self._held(seq, num_tokens)
        return self.block_manager.blocks_for(num_tokens) - seq.prompt_len // self.block_manager.block_size

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
        """One step. Prefilled `choices` requests are scored in a step of their own. Otherwise every
        prefilled sequence decodes one token, and what is left of the token budget goes to prompt chunks:
        prefills in progress first, then new admissions (a prompt longer than what is left is computed
        over several steps). Decode rows ride in the same forward pass as the chunks."""
        scoring = self._scoring()
        if scoring:
            return self._batch("score", scoring)
        if self.running:
            self._make_room()
        decoding = [s for s in self.running if s.prefilled and s.labels is None]
        budget = self.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[Sequence, int]] = []
        prefilling = [] if len(decoding) == len(self.running) else self.running
        for seq in prefilling:
            if not seq.prefilled and budget > 0:
                n = min(len(seq.prefill_ids) - seq.num_computed, budget)
                if self.slides(seq):  # its blocks come chunk by chunk (the rest did at admission)
                    self.block_manager.slide(seq.request_id, seq.num_computed)
                    self.block_manager.ensure_capacity(seq.request_id, seq.num_computed + n)
                chunks.append((seq, n))
                budget -= n
        if budget > 0:
            chunks += self._admit(budget)
        if not decoding and not chunks:
            return None
        phase: Phase = "decode" if not chunks else "prefill" if not decoding else "mixed"
        batch = self._batch(phase, decoding + [s for s, _ in chunks])
        batch.num_decode = len(decoding)
        batch.chunks = [n for _, n in chunks]
        for i, (seq, n) in enumerate(chunks, start=len(decoding)):
            if seq.num_computed + n == len(seq.prefill_ids):
                batch.forks += [(i, f) for f in seq.forks]
        return batch

    def schedule_decode(self) -> ScheduledBatch | None:
        """The next decode step while one is in flight (Engine's overlap; the engine checked that every running
        sequence is prefilled and plain, and that none can be admitted): every running sequence whose tokens
        in flight leave it short of max_new_tokens, each counting them."""
        if self.running:
            self._make_room()
        decoding = [s for s in self.running if len(s.output_ids) + s.inflight < s.max_new_tokens]
        if not decoding:
            return None
        batch = self._batch("decode", decoding)
        batch.num_decode = len(decoding)
        return batch

    def _seats_for_head(self) -> int | None:
        """The seats taken (running sequences and the samples still to fork from them: max_num_seqs bounds the
        sum) where the waiting head (and its samples) would find one; None where none waits or it would not."""
        if not self.waiting:
            return None
        seats = len(self.running) + sum(map(len, map(_FORKS, self.running)))
        return None if seats + 1 + len(self.waiting[0].forks) > self.max_num_seqs else seats

    def admission_closed(self) -> bool:
        """Whether no waiting sequence can be admitted now (the engine's overlap goes on while so): none waits,
        no seat is free, or the pool refused the head when it was last tried, nothing has ended since, and
        fewer than REFUSAL_STEPS steps have passed (the running sequences' expected growth shrinks as they
        advance: the head is tried again after that many, by a serial step)."""
        if self._seats_for_head() is None:
            return True
        if self.waiting[0] is self._refused and self._refused_steps < REFUSAL_STEPS:
            self._refused_steps += 1
            return True
        return False

    def fork(self, batch: ScheduledBatch) -> list[tuple[int, int]]:
        """After computed(batch): start the samples forked in this step as running, prefilled sequences
        that share their leader's prompt blocks. -> (source, destination) blocks whose K/V to copy."""
        copies: list[tuple[int, int]] = []
        for i, child in batch.forks:
            leader = batch.seqs[i]
            assert leader.prefilled and child in leader.forks
            leader.forks.remove(child)
            grown = child.max_total_tokens if self.admission == "reserve" else child.prompt_len
            extra = self._fork_blocks(leader, grown)
            copy = self.block_manager.fork(leader.request_id, child.request_id, leader.num_computed, extra)
            if copy is not None:
                copies.append(copy)
            child.num_computed = child.num_cached_tokens = leader.num_computed
            child.cached_prompt_tokens = leader.cached_prompt_tokens
            child.prompt_hashes = leader.prompt_hashes
            if leader.lora_slot >= 0 and self.loras is not None:
                self.loras.hold(leader.lora_slot)
                child.lora_slot = leader.lora_slot
            child.prefilled = True
            child.status = "running"
            self.running.append(child)
        return copies

    def computed(self, batch: ScheduledBatch) -> list[Sequence]:
        """After the runner ran `batch` (its K/V is in the pool): advance the prompt chunks and offer the
        newly filled blocks to the prefix cache. -> the sequences whose prefill this step completed."""
        bm = self.block_manager
        if bm.prefix_caching:  # without it there is nothing to register
            for seq in batch.seqs[: batch.num_decode]:
                bm.cache_computed(seq.request_id, seq.hashed_prompt, seq.output_ids, seq.num_tokens)
        done: list[Sequence] = []
        for seq, chunk in zip(batch.seqs[batch.num_decode :], batch.chunks, strict=True):
            seq.num_computed += chunk
            bm.cache_computed(seq.request_id, seq.hashed_prompt, seq.output_ids, seq.num_computed)
            if seq.num_computed == len(seq.prefill_ids):
                seq.prefilled = True
                done.append(seq)
        return done

    def _make_room(self) -> None:
        """Give every running sequence the slot its next token is written to (the last sampled token is
        not cached yet: the decode step writes it at position num_tokens - 1), oldest first, preempting
        the newest where the pool runs out. Under "reserve" the slot is always within the reservation."""
        bm = self.block_manager
        if bm.window is None:
            # Most decode steps fill a slot the table already has (Sequence.kv_room): only the others grow.
            # (a token in flight, Engine's overlap, counts: the step that takes it writes its K/V)
            short = [s for s in self.running if len(s.output_ids) + s.inflight > s.kv_room]
            for seq in short:
                while seq.status == "running":
                    if bm.grow(seq.request_id, seq.num_tokens + seq.inflight):
                        seq.kv_room = bm.capacity(seq.request_id) - seq.prompt_len
                        break
                    self.preempt(self.running[-1])  # the newest; it may be `seq` itself
            return
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self.slides(seq):
                if not seq.prefilled:  # its next chunk's blocks come with the chunk (schedule)
                    i += 1
                    continue
                bm.slide(
                    seq.request_id, seq.num_tokens + seq.inflight - 1
                )  # its next token is computed there
            if bm.grow(seq.request_id, seq.num_tokens + seq.inflight):
                i += 1
                continue
            self.preempt(self.running[-1])  # the newest; it may be `seq` itself, the loop then ends

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks back and queue it first, to resume by recomputation."""
        self.running.remove(seq)
        self.block_manager.release(seq.request_id)
        self._drop_adapter(seq)
        seq.kv_room = -1
        seq.status = "waiting"
        seq.num_cached_tokens = seq.num_computed = 0
        seq.prefilled = False
        seq.prompt_hashes = None  # it will prefill prompt + output
        seq.pooled = None  # an embedding input's mean restarts with its prefill
        seq.preemptions += 1
        self.preemptions += 1
        self._used = max(self._used, INIT_NEW_TOKEN_RATIO / RATIO_MARGIN)  # the estimate was too low
        self.new_token_ratio = max(self.new_token_ratio, INIT_NEW_TOKEN_RATIO)
        self._order[seq.request_id] = (RESUME_FIRST, next(self._arrivals))
        bisect.insort(self.waiting, seq, key=lambda s: self._order[s.request_id])

    def _take_adapter(self, seq: Sequence) -> bool:
        """Its LoRA adapter's slot, held (the adapter loaded into one where none holds it); False where every
        slot is held by other adapters' running sequences."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        slot = None if self.loras is None else self.loras.acquire(seq.lora)
        seq.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _drop_adapter(self, seq: Sequence) -> None:
        """Its adapter's slot, held no more (it may leave for another adapter)."""
        if seq.lora_slot >= 0 and self.loras is not None:
            self.loras.release(seq.lora_slot)
        seq.lora_slot = -1

    def _held(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the sequence holds at most once it holds num_tokens tokens."""
        bm = self.block_manager
        return bm.held_bound(num_tokens) if self.slides(seq) else bm.blocks_for(num_tokens)

    def _expected_growth(self, seq: Sequence) -> int:
        """Blocks a sequence is expected to still take: new_token_ratio of its remaining tokens (a sliding
        one stops growing once it holds its window's worth)."""
        grown = seq.num_tokens + int(self.new_token_ratio * seq.remaining_tokens)
        return self._held(seq, grown) - self._held(seq, seq.num_tokens)

    def _scoring(self) -> list[Sequence]:
        """Prefilled `choices` requests whose label rows fit this step's budget (the first always goes)."""
        bm = self.block_manager
        picked: list[Sequence] = []
        tokens = 0
        for seq in list(self.running):
            if seq.labels is None or not seq.prefilled or seq.status != "running":
                continue
            rows = sum(len(label) for label in seq.labels) + len(seq.labels) * bm.block_size  # upper bound
            if picked and tokens + rows > self.max_num_batched_tokens:
                break
            # Its scratch blocks after its context's (the prompt's; a reasoning model's thinking too): within
            # its reservation, or, where the thinking outgrew an optimistic one, what the pool gives.
            end = (bm.blocks_for(seq.num_tokens) + seq.scratch_blocks) * bm.block_size
            while not bm.grow(seq.request_id, end):
                self.preempt(self.running[-1])  # the newest; it may be `seq` itself
                if seq.status != "running":
                    break
            if seq.status != "running":
                continue
            bm.ensure_capacity(seq.request_id, end)
            picked.append(seq)
            tokens += rows
        return [s for s in picked if s.status == "running"]  # a later one's room may have preempted it

    def _admit(self, budget: int) -> list[tuple[Sequence, int]]:
        """Admit waiting sequences while the pool and `budget` prompt tokens allow. -> (seq, chunk)."""
        bm = self.block_manager
        admitted: list[tuple[Sequence, int]] = []
        seats = self._seats_for_head()
        if seats is None:
            return admitted  # nothing can join: the per-sequence sums below are every decode step's cost
        tokens = 0
        computing: set[BlockHash] = set()  # prompt blocks that prefills in progress are computing
        for s in self.running:
            if not s.prefilled and s.prompt_hashes is not None:
                computing.update(s.prompt_hashes[s.num_computed // bm.block_size :])
        optimistic = self.admission == "optimistic"
        growth = sum(self._expected_growth(s) for s in self.running) if optimistic else 0
        while self.waiting:
            seq = self.waiting[0]
            seats += 1 + len(seq.forks)
            if seats > self.max_num_seqs:
                break
            ids = seq.prefill_ids
            if seq.prompt_hashes is None:
                seq.prompt_hashes = bm.prompt_hashes(seq.hashed_prefill, seq.lora_digest)
            mean = seq.pooling == "mean"  # every input token's hidden state is needed: computed, not cached
            hit = PrefixHit() if mean else bm.match_prefix(seq.prompt_hashes)
            if not mean and hit.end < len(seq.prompt_hashes) and seq.prompt_hashes[hit.end] in computing:
                break
            if optimistic:  # hold what its prompt fills (and a choices request's scratch); expect the rest
                need = self._held(seq, len(ids)) + seq.scratch_blocks
                need += len(seq.forks) * self._fork_blocks(seq, len(ids))
                expected = growth + self._expected_growth(seq) * (1 + len(seq.forks))
            else:
                need, expected = self.blocks_needed(seq), 0
            if not bm.can_admit(need + expected, hit.blocks):
                if not admitted:  # (admission_closed: the head waits for the pool)
                    self._refused, self._refused_steps = seq, 0
                break
            cached = hit.end * bm.block_size
            chunk = min(len(ids) - cached, budget - tokens)
            # (an adapter's request waits while running requests of others hold every adapter slot)
            if chunk <= 0 or not self._take_adapter(seq):
                break
            self.waiting.pop(0)
            del self._order[seq.request_id]
            bm.admit(seq.request_id, need, hit.blocks, seq.prompt_hashes, hit.first, seq.lora_digest)
            bm.ensure_capacity(seq.request_id, cached + chunk if self.slides(seq) else len(ids))
            growth = expected
            seq.num_cached_tokens = seq.num_computed = cached
            if not seq.preemptions:
                seq.cached_prompt_tokens = cached
            seq.status = "running"
            self.running.append(seq)
            admitted.append((seq, chunk))
            computing.update(seq.prompt_hashes[hit.end :])
            tokens += chunk
        return admitted

    def _batch(self, phase: Phase, seqs: list[Sequence]) -> ScheduledBatch:
        bm = self.block_manager
        ids = list(map(_REQUEST_ID, seqs))
        rows = list(map(bm.rows.row_of.__getitem__, ids))
        released = [0] * len(seqs) if bm.window is None else list(map(bm.released, ids))
        tables = BlockTables(bm, ids, released)  # (a decode step reads its rows instead)
        return ScheduledBatch(phase, seqs, tables, released=released, rows=rows, table_rows=bm.rows)

    def window_idle_blocks(self, window: int) -> int:
        """Blocks running sequences hold that lie wholly before their next token's `window`: what layers of
        that window no longer read (with one table shared by every layer, a full-attention layer keeps
        them; per-layer tables would free them in the windowed layers)."""
        bm = self.block_manager
        idle = 0
        for seq in self.running:
            nxt = seq.num_tokens - 1 if seq.prefilled else seq.num_computed
            idle += max(0, max(0, nxt - window + 1) // bm.block_size - bm.released(seq.request_id))
        return idle

    def check_invariants(self) -> None:
        """The block manager's, and per running sequence: its table covers what it has computed, and the
        window released no block its next token still reads."""
        bm = self.block_manager
        bm.check_invariants()
        for seq in self.running:
            rid = seq.request_id
            nxt = seq.num_tokens - 1 if seq.prefilled else seq.num_computed
            held_to = (bm.released(rid) + len(bm.block_table(rid))) * bm.block_size
            assert held_to >= seq.num_computed, f"{rid}: computed tokens without blocks"
            # (a choices request never slides, but its prefix hit may leave out blocks no window reaches)
            assert bm.released(rid) <= bm.first_needed(nxt), f"{rid}: a block its window reads was released"

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
            del self._order[seq.request_id]
        seq.status = "finished"
        self._refused = None  # its blocks may admit the head
        self.block_manager.release(seq.request_id)
        self._drop_adapter(seq)
        if seq.finish_reason in ("eos", "stop", "length", "repetition") and seq.max_new_tokens > 0:
            used = len(seq.output_ids) / seq.max_new_tokens
            self._used += RATIO_WEIGHT * (used - self._used)
            self.new_token_ratio = min(1.0, max(MIN_NEW_TOKEN_RATIO, RATIO_MARGIN * self._used))
