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
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

BlockHash = bytes  # 16 bytes of blake2b: a chain hash of a full block's tokens and all before them


def chain_hash(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, salt: bytes = b""
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.root: BlockHash = hashlib.blake2b(b"batchq-kv\0" + salt, digest_size=16).digest()
        self._refs = [0] * num_blocks
        # Blocks no sequence holds, in the order they are handed out: uncached ones first, then cached
        # ones least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}  # registered block -> its chain hash
        self._block_of: dict[BlockHash, int] = {}  # chain hash -> registered block
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chain hashes of a sequence's computed full blocks
        self._reserved: dict[str, int] = {}  # table length each sequence may reach (its reservation)
        self._growth = 0  # blocks running sequences may still allocate: sum(reserved - len(table))
        self.hit_blocks = 0  # prefix-cache hits and evictions since start (stats)
        self.evicted_blocks = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
        """Blocks held plus blocks that running sequences may still allocate."""
        return self.num_used + self._growth

    # ---- admission ------------------------------------------------------------------------------

    def prompt_hashes(self, token_ids: list[int]) -> list[BlockHash]:
        """Chain hashes of the prompt's full blocks that a cache hit may cover: the last prompt token is
        always computed (its logits are needed), so a block that ends the prompt is left out."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        out: list[BlockHash] = []
        parent = self.root
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            parent = chain_hash(parent, token_ids[start : start + bs])
            out.append(parent)
        return out

    def match_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """The registered blocks of the longest cached prefix of `hashes` (from prompt_hashes)."""
        blocks: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def new_blocks_needed(self, need: int, hits: list[int]) -> int:
        """What admitting a sequence that reserves `need` blocks with these cache hits takes from the pool."""
        return need - sum(1 for b in hits if self._refs[b] > 0)

    def can_admit(self, need: int, hits: list[int]) -> bool:
        return self.num_committed + self.new_blocks_needed(need, hits) <= self.num_blocks

    def admit(self, seq_id: str, need: int, hits: list[int], hashes: list[BlockHash]) -> None:
        """Reserve `need` blocks for a new sequence and hand it the hit blocks as its table's start."""
        assert seq_id not in self._reserved, f"{seq_id} already holds a reservation"
        assert self.can_admit(need, hits), "admission must check can_admit first"
        assert len(hits) <= need and hashes[: len(hits)] == [self._hash_of[b] for b in hits]
        for b in hits:
            self._take(b)
        self.hit_blocks += len(hits)
        self._tables[seq_id] = list(hits)
        self._hashes[seq_id] = list(hashes[: len(hits)])
        self._reserved[seq_id] = need
        self._growth += need - len(hits)

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Cover `num_tokens` slots, raising the sequence's reservation where it must and the pool allows
        it (optimistic admission); False when it does not, and nothing changed."""
        extra = self.blocks_for(num_tokens) - self._reserved[seq_id]
        if extra > 0:
            if self.num_committed + extra > self.num_blocks:
                return False
            self._reserved[seq_id] += extra
            self._growth += extra
        self.ensure_capacity(seq_id, num_tokens)
        return True

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> None:
        """Allocate blocks until the sequence's table covers `num_tokens` token slots."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens)
        assert need <= self._reserved[seq_id], f"{seq_id} grew past its reservation"
        while len(table) < need:
            b = next(iter(self._free))  # cannot be empty: reservations fit in the pool
            h = self._hash_of.pop(b, None)
            if h is not None:  # evict: its K/V is about to be overwritten
                del self._block_of[h]
                self.evicted_blocks += 1
            self._take(b)
            table.append(b)
            self._growth -= 1

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
        table = self._tables[seq_id]
        token_ids = prompt_ids + output_ids if output_ids and num_computed > len(prompt_ids) else prompt_ids
        parent = hashes[-1] if hashes else self.root
        for i in range(len(hashes), num_computed // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
            b = table[i]
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
        self._hashes.pop(seq_id)
        self._growth -= self._reserved.pop(seq_id) - len(table)
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                if b not in self._hash_of:  # nothing worth keeping: hand it out first
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
        for seq_id, table in self._tables.items():
            assert len(table) <= self._reserved[seq_id], f"{seq_id} holds more than it reserved"
            growth += self._reserved[seq_id] - len(table)
            hashes = self._hashes[seq_id]
            assert len(hashes) <= len(table)
            for b, h in zip(table, hashes, strict=False):  # a registered block holds what its hash says
                assert self._hash_of.get(b, h) == h
        assert growth == self._growth, "growth reservations out of step"
        assert self.num_committed <= self.num_blocks, "the pool is over-committed"
