"""Paged KV-cache bookkeeping with automatic prefix caching. Pure Python (no torch).

The pool is `num_blocks` blocks of `block_size` token slots. A sequence holds a block table; blocks are
reference-counted, so sequences that share a prompt prefix share its blocks.

Prefix cache: once a full block's K/V is computed, the block is registered under a chain hash of its
content, hash(parent block's hash, the block's token ids), rooted in a salt for whatever else changes
K/V (model, dtype, block size). A new sequence takes the longest run of registered blocks that matches
its prompt (`match_prefix`) and computes only the rest. A block whose last user finished keeps its K/V
and its registration in the free queue, least recently freed first; it is evicted (unregistered) only
when the pool hands it out again.

Reservations: a sequence is admitted with a reservation of blocks (`admit`), allocates them as it grows
(`ensure_capacity`), and may raise its reservation later (`grow`) while the pool has room. What a
reservation costs the pool is only the blocks it newly takes: a cached block that another running
sequence already holds costs nothing more. The scheduler decides how much to reserve (its admission rule,
scheduler.py), a `choices` request's scratch blocks included: under "reserve" a sequence's worst case,
ceil((prompt + max_new_tokens) / block_size) blocks, so `grow` never has to raise it; under "optimistic"
only what its prompt fills now, so `grow` may find no room, and the scheduler then preempts a sequence to
make some. Either way the pool is never over-committed:

    blocks held by running sequences (each counted once) + blocks they may still allocate <= num_blocks.

Sliding windows (kv_window.SlidingWindow, only where every layer of the model has one): a query at position
p reads keys from p - window + 1 on in every layer, so a sequence whose next computed token (a prompt
chunk's first, or a decode step's) is at p needs no block that ends before p - window + 1. `slide` releases
those blocks back to the pool as the sequence advances (`window_released` counts them); the table keeps its
logical positions, the released ones before its first held block (`released`). A released block is freed
like any other: it keeps its registration and K/V in the free queue. A reservation then counts blocks held
at once, not the blocks of the whole sequence: `held_bound` is a windowed sequence's worst case. A prefix
hit needs only the registered blocks its first computed token's window reaches (`match_prefix`), so the
earliest blocks of a long cached prefix may have been evicted. A block two sequences share may be released
by one while the other still holds it, so under a window sharing earns no credit: what is committed is the
sum of the reservations (each at most held_bound), not the blocks held plus what each may still take,
which counts a shared block once. Where some layer attends to the whole context, every layer shares the one
block table and nothing can be released: the window's saving would need per-layer tables (the engine
counts what they would free).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from worker.engine.kv_window import PrefixHit, SlidingWindow

BlockHash = bytes  # 16 bytes of blake2b: a chain hash of a full block's tokens and all before them


class TableRows:
    """Every held block table as a row of one int32 buffer (`data`, `capacity` rows of `width`), kept in
    step with the tables as they change: the model runner reads a decode step's block tables out of it in
    one gather (a view over the buffer, torch.frombuffer) instead of padding a list per sequence each step.
    A row holds its table's logical blocks (RELEASED_BLOCK, 0, for those a window released) and zeros
    after them, as a padded table does. `data` is replaced, never resized, when it must grow (a buffer
    a tensor views cannot be resized): a reader compares it by identity."""

    def __init__(self, width: int = 16, capacity: int = 16) -> None:
        self.width = width
        self.capacity = capacity
        self.data = array("i", bytes(4 * width * capacity))
        self.row_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def add(self, seq_id: str, first: int, blocks: list[int]) -> None:
        """A new table: logical blocks `first` on are `blocks`."""
        if not self._free:
            self._relayout(self.width, 2 * self.capacity)
        r = self._free.pop()
        self.row_of[seq_id] = r
        w = self.width
        self.data[r * w : (r + 1) * w] = array("i", bytes(4 * w))
        self.put(seq_id, first, blocks)

    def put(self, seq_id: str, at: int, blocks: list[int]) -> None:
        """Logical blocks `at` on of the sequence's table are `blocks`."""
        end = at + len(blocks)
        if end > self.width:
            self._relayout(max(2 * self.width, end), self.capacity)
        start = self.row_of[seq_id] * self.width + at
        self.data[start : start + len(blocks)] = array("i", blocks)

    def remove(self, seq_id: str) -> None:
        self._free.append(self.row_of.pop(seq_id))

    def _relayout(self, width: int, capacity: int) -> None:
        old, ow = self.data, self.width
        data = array("i", bytes(4 * width * capacity))
        for r in range(self.capacity):
            data[r * width : r * width + ow] = old[r * ow : (r + 1) * ow]
        self._free = list(range(capacity - 1, self.capacity - 1, -1)) + self._free
        self.data, self.width, self.capacity = data, width, capacity


def chain_hash(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        salt: bytes = b"",
        window: SlidingWindow | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window
        self.root: BlockHash = hashlib.blake2b(b"batchq-kv\0" + salt, digest_size=16).digest()
        self._refs = [0] * num_blocks
        # Blocks no sequence holds, in the order they are handed out: uncached ones first, then cached
        # ones least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}  # registered block -> its chain hash
        self._block_of: dict[BlockHash, int] = {}  # chain hash -> registered block
        self._tables: dict[str, list[int]] = {}  # the blocks a sequence holds, from logical block released on
        self._released: dict[str, int] = {}  # its leading logical blocks the window released
        self._hashes: dict[str, list[BlockHash]] = {}  # chain hashes of a sequence's computed full blocks
        self._roots: dict[str, BlockHash] = {}  # a sequence's own root (a LoRA adapter's), where not `root`
        self._reserved: dict[str, int] = {}  # blocks each sequence may hold at once (its reservation)
        self._growth = 0  # blocks running sequences may still allocate: sum(reserved - len(table))
        self._reserved_sum = 0  # sum(reserved): what a window commits
        self.hit_blocks = 0  # prefix-cache hits and evictions since start (stats)
        self.evicted_blocks = 0
        self.window_released = 0  # blocks `slide` returned to the pool since start (stats)
        self.rows = TableRows()  # the tables again, as rows of one buffer (the runner's decode steps read it)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def held_bound(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once: all of them, or with a window
        (and `slide` called before each chunk) at most SlidingWindow.held_blocks."""
        whole = self.blocks_for(num_tokens)
        return whole if self.window is None else min(whole, self.window.held_blocks(self.block_size))

    def first_needed(self, position: int) -> int:
        """The first logical block that a token computed at `position` (and every later one) reads."""
        if self.window is None:
            return 0
        return max(0, position - self.window.tokens + 1) // self.block_size

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks, held or free: what a new prompt can hit."""
        return len(self._block_of)

    @property
    def num_committed(self) -> int:
        """Blocks held plus blocks that running sequences may still allocate; under a window, the sum of
        the reservations (see the module docstring)."""
        return self.num_used + self._growth if self.window is None else self._reserved_sum

    # ---- admission ------------------------------------------------------------------------------

    def root_of(self, salt: str) -> BlockHash:
        """The root of the chain hashes of sequences computed with `salt` (a LoRA adapter's digest: the same
        tokens give other K/V under another adapter); "": the base model's."""
        return self.root if not salt else hashlib.blake2b(self.root + salt.encode(), digest_size=16).digest()

    def prompt_hashes(self, token_ids: list[int], salt: str = "") -> list[BlockHash]:
        """Chain hashes of the prompt's full blocks that a cache hit may cover: the last prompt token is
        always computed (its logits are needed), so a block that ends the prompt is left out."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        out: list[BlockHash] = []
        parent = self.root_of(salt)
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            parent = chain_hash(parent, token_ids[start : start + bs])
            out.append(parent)
        return out

    def match_prefix(self, hashes: list[BlockHash]) -> PrefixHit:
        """The longest cached prefix of `hashes` (from prompt_hashes): the most blocks n such that every
        block the token after them reads (first_needed: all n without a window) is registered. A block's
        chain hash names every token before it, so a registered block holds the K/V this prompt's would."""
        bs = self.block_size
        best = 0
        missing = -1  # the last block index not registered so far
        for n in range(1, len(hashes) + 1):
            if hashes[n - 1] not in self._block_of:
                missing = n - 1
            if missing < self.first_needed(n * bs):
                best = n
        first = self.first_needed(best * bs)
        return PrefixHit(first, [self._block_of[h] for h in hashes[first:best]])

    def new_blocks_needed(self, need: int, hits: list[int]) -> int:
        """What admitting a sequence that reserves `need` blocks with these cache hits takes from the pool
        (under a window, all of it: see the module docstring)."""
        if self.window is not None:
            return need
        return need - sum(1 for b in hits if self._refs[b] > 0)

    def can_admit(self, need: int, hits: list[int]) -> bool:
        return self.num_committed + self.new_blocks_needed(need, hits) <= self.num_blocks

    def admit(
        self, seq_id: str, need: int, hits: list[int], hashes: list[BlockHash], first: int = 0, salt: str = ""
    ) -> None:
        """Reserve `need` blocks (held at once) for a new sequence and hand it the hit blocks as its table's
        start, logical blocks `first` on (a PrefixHit's; the ones before it count as released). salt: as
        its prompt_hashes'."""
        assert seq_id not in self._reserved, f"{seq_id} already holds a reservation"
        assert self.can_admit(need, hits), "admission must check can_admit first"
        end = first + len(hits)
        assert len(hits) <= need and hashes[first:end] == [self._hash_of[b] for b in hits]
        assert first <= self.first_needed(end * self.block_size), "a hit must hold what its window reads"
        for b in hits:
            self._take(b)
        self.hit_blocks += len(hits)
        self._tables[seq_id] = list(hits)
        self.rows.add(seq_id, first, hits)
        self._released[seq_id] = first
        self._hashes[seq_id] = list(hashes[:end])
        if salt:
            self._roots[seq_id] = self.root_of(salt)
        self._reserved[seq_id] = need
        self._reserved_sum += need
        self._growth += need - len(hits)

    def fork(self, parent_id: str, child_id: str, num_tokens: int, extra: int) -> tuple[int, int] | None:
        """Start `child_id` as a copy of the parent's first `num_tokens` computed tokens (n > 1): it shares
        the full blocks (one more reference each) and gets a block of its own for a partial last one, since
        its next token is written there. The parent hands `extra` blocks of its reservation to the child,
        which reserves them and the shared blocks (no credit for those under a window, as at admission).
        -> (source, destination) of the partial block, whose K/V the caller copies; None when there is none."""
        table, released = self._tables[parent_id], self._released[parent_id]
        shared = table[: num_tokens // self.block_size - released]
        reserve = extra + (len(shared) if self.window is None else 0)
        assert child_id not in self._reserved and self._reserved[parent_id] - extra >= len(table)
        for b in shared:
            self._take(b)
        self._tables[child_id] = list(shared)
        self.rows.add(child_id, released, shared)
        self._released[child_id] = released
        self._hashes[child_id] = list(self._hashes[parent_id])
        if parent_id in self._roots:
            self._roots[child_id] = self._roots[parent_id]
        self._reserved[parent_id] -= extra
        self._reserved[child_id] = reserve
        self._reserved_sum += reserve - extra
        self._growth += reserve - len(shared) - extra
        if num_tokens % self.block_size == 0:
            return None
        self.ensure_capacity(child_id, num_tokens)
        return table[len(shared)], self._tables[child_id][-1]

    def released(self, seq_id: str) -> int:
        """The sequence's leading logical blocks the window released (none without a window)."""
        return self._released[seq_id]

    def slide(self, seq_id: str, position: int) -> int:
        """The sequence's next computed token is at `position`: release its blocks that no layer's window
        reaches from there (first_needed). Its reservation stays: the blocks it will take next count
        against it as before. -> blocks released."""
        table = self._tables[seq_id]
        k = min(self.first_needed(position) - self._released[seq_id], len(table))
        if k <= 0:
            return 0
        for b in table[:k]:
            self._free_one(b)
        del table[:k]
        self.rows.put(seq_id, self._released[seq_id], [0] * k)  # RELEASED_BLOCK (scheduler.py)
        self._released[seq_id] += k
        self._growth += k
        self.window_released += k
        return k

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Cover `num_tokens` slots, raising the sequence's reservation where it must and the pool allows
        it (optimistic admission); False when it does not, and nothing changed."""
        need = -(-num_tokens // self.block_size) - self._released[seq_id]
        if need <= len(self._tables[seq_id]):  # covered already (most decode steps): within the reservation
            return True
        extra = need - self._reserved[seq_id]
        if extra > 0:
            if self.num_committed + extra > self.num_blocks:
                return False
            self._reserved[seq_id] += extra
            self._reserved_sum += extra
            self._growth += extra
        self.ensure_capacity(seq_id, num_tokens)
        return True

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> None:
        """Allocate blocks until the sequence's table covers `num_tokens` token slots."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens) - self._released[seq_id]
        assert need <= self._reserved[seq_id], f"{seq_id} grew past its reservation"
        if len(table) >= need:
            return
        at = len(table)
        while len(table) < need:
            b = next(iter(self._free))  # cannot be empty: reservations fit in the pool
            h = self._hash_of.pop(b, None)
            if h is not None:  # evict: its K/V is about to be overwritten
                del self._block_of[h]
                self.evicted_blocks += 1
            self._take(b)
            table.append(b)
            self._growth -= 1
        self.rows.put(seq_id, self._released[seq_id] + at, table[at:])

    def capacity(self, seq_id: str) -> int:
        """The token slots the sequence's table covers (released blocks included)."""
        return (self._released[seq_id] + len(self._tables[seq_id])) * self.block_size

    def cache_computed(
        self, seq_id: str, prompt_ids: list[int], output_ids: list[int], num_computed: int
    ) -> None:
        """Register the sequence's full blocks whose K/V is now computed (its first `num_computed` tokens,
        prompt then output).

        A block whose content another block already holds (two equal prompts computed in one step)
        stays unregistered; it is freed like any other when its sequence ends.
        """
        hashes = self._hashes[seq_id]
        bs = self.block_size
        if not self.prefix_caching or num_computed // bs <= len(hashes):
            return
        table, released = self._tables[seq_id], self._released[seq_id]
        token_ids = prompt_ids + output_ids if output_ids and num_computed > len(prompt_ids) else prompt_ids
        parent = hashes[-1] if hashes else self._roots.get(seq_id, self.root)
        for i in range(len(hashes), num_computed // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
            assert i >= released, "a block is registered before the window releases it"
            b = table[i - released]
            if parent not in self._block_of and b not in self._hash_of:
                self._block_of[parent] = b
                self._hash_of[b] = parent

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def release(self, seq_id: str) -> None:
        """Return a sequence's blocks and the rest of its reservation; a no-op for one never admitted.

        Blocks are released last first: the end of a sequence is the least likely to be shared, so
        among cached blocks it is evicted first.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        self.rows.remove(seq_id)
        self._hashes.pop(seq_id)
        self._roots.pop(seq_id, None)
        self._released.pop(seq_id)
        reserved = self._reserved.pop(seq_id)
        self._reserved_sum -= reserved
        self._growth -= reserved - len(table)
        for b in reversed(table):
            self._free_one(b)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no sequence holds (vLLM's reset_prefix_cache): the next prompts are
        computed afresh. Blocks that running sequences hold stay registered. Returns the blocks forgotten."""
        dropped = [b for b in self._free if b in self._hash_of]
        for b in dropped:
            del self._block_of[self._hash_of.pop(b)]
            self._free.move_to_end(b, last=False)
        return len(dropped)

    def _free_one(self, b: int) -> None:
        """Drop one reference to block b; unreferenced, it joins the free queue: last if it is registered
        (evicted after the blocks freed before it), first if not (nothing worth keeping)."""
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self._free[b] = None
            if b not in self._hash_of:
                self._free.move_to_end(b, last=False)

    def _take(self, b: int) -> None:
        if self._refs[b] == 0:
            del self._free[b]
        self._refs[b] += 1

    def check_invariants(self) -> None:
        """Every bookkeeping identity of the pool; tests call it after each step."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(table) == len(set(table)), "a block appears twice in one table"
            for b in table:
                refs[b] += 1
        assert refs == self._refs, "reference counts differ from the block tables"
        assert set(self._free) == {b for b in range(self.num_blocks) if refs[b] == 0}, "free != unreferenced"
        assert len(self._hash_of) == len(self._block_of), "hash maps out of step"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
        growth = 0
        assert set(self._released) == set(self._tables) == set(self._reserved) == set(self._hashes)
        for seq_id, table in self._tables.items():
            assert len(table) <= self._reserved[seq_id], f"{seq_id} holds more than it reserved"
            growth += self._reserved[seq_id] - len(table)
            released = self._released[seq_id]
            assert released == 0 or self.window is not None, f"{seq_id} released blocks without a window"
            hashes = self._hashes[seq_id]
            assert len(hashes) <= released + len(table)
            # a registered block holds what its hash says
            for b, h in zip(table, hashes[released:], strict=False):
                assert self._hash_of.get(b, h) == h
        assert growth == self._growth, "growth reservations out of step"
        rows, w = self.rows, self.rows.width
        assert set(rows.row_of) == set(self._tables), "table rows out of step"
        for seq_id, table in self._tables.items():
            r, released = rows.row_of[seq_id], self._released[seq_id]
            padded = [0] * released + table + [0] * (w - released - len(table))
            assert rows.data[r * w : (r + 1) * w].tolist() == padded, (
                f"{seq_id}: its table row is out of step"
            )
        assert sum(self._reserved.values()) == self._reserved_sum, "reservations out of step"
        assert self.num_committed <= self.num_blocks, "the pool is over-committed"
