"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and one block table per sequence.

Pure Python (no torch): the model runner only ever sees the block tables.
Each sequence *reserves* its worst case up front (admission guarantees the reservations fit in the
pool) and *allocates* physical blocks lazily as it grows, so nothing can ever run out of memory.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._reserved: dict[str, int] = {}
        self._reserved_total = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_reserved(self) -> int:
        return self._reserved_total

    def can_reserve(self, num_blocks: int) -> bool:
        return self._reserved_total + num_blocks <= self.num_blocks

    def reserve(self, seq_id: str, num_blocks: int) -> None:
        """Claim a worst-case budget of blocks for a newly admitted sequence."""
        assert seq_id not in self._reserved, f"{seq_id} already holds a reservation"
        assert self.can_reserve(num_blocks), "admission must check can_reserve first"
        self._reserved[seq_id] = num_blocks
        self._reserved_total += num_blocks
        self._tables[seq_id] = []

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> None:
        """Allocate blocks until the sequence's table covers `num_tokens` token slots."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens)
        assert need <= self._reserved[seq_id], f"{seq_id} grew past its reservation"
        while len(table) < need:
            table.append(self._free.popleft())  # cannot be empty: reservations fit in the pool

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def release(self, seq_id: str) -> None:
        """Return a sequence's blocks and reservation; a no-op for a sequence that never got one."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(table)
        self._reserved_total -= self._reserved.pop(seq_id, 0)

    def check_invariants(self) -> None:
        owned = [b for table in self._tables.values() for b in table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "free + used != total"
        assert self._reserved_total == sum(self._reserved.values()) <= self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) <= self._reserved[seq_id]
