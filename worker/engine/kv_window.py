"""What a sliding window means for a sequence's KV blocks: the window every layer leaves the cache, how
many blocks it keeps at once, and the part of a prompt a prefix-cache hit covers. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlidingWindow:
    """Every layer attends to at most the last `tokens` keys, a query's own included (the model's largest
    window, where every layer has one); a step computes at most `max_chunk` tokens of one sequence (the
    step's token budget)."""

    tokens: int
    max_chunk: int

    @classmethod
    def of_layers(cls, windows: tuple[int | None, ...], max_chunk: int) -> SlidingWindow | None:
        """The window a model's layers leave the cache (their largest), or None where some layer has none
        (or there are no layers)."""
        if not windows or any(w is None for w in windows):
            return None
        return cls(max(w for w in windows if w is not None), max_chunk)

    def held_blocks(self, block_size: int) -> int:
        """The most blocks a sequence holds at once: a chunk of max_chunk tokens from position p reads
        positions p - tokens + 1 .. p + max_chunk - 1, which span this many blocks at worst."""
        span = self.tokens + self.max_chunk - 1
        return -(-(span - 1) // block_size) + 1


@dataclass(frozen=True)
class PrefixHit:
    """The cached part of a prompt: logical blocks first .. first + len(blocks) - 1 (registered), and the
    tokens before them, which no layer's window reaches from the first token computed after the hit."""

    first: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Prompt blocks the hit covers: the first one computed is this one."""
        return self.first + len(self.blocks)
