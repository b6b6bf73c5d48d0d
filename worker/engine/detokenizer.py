"""Incremental detokenisation: emits only complete characters, never special tokens.

Keeps two offsets into the generated ids (the vLLM scheme): text is decoded from a short window that
starts a few tokens back, so multi-token characters (Chinese, emoji) and word-initial spaces come out
right, and a window ending in U+FFFD (an incomplete UTF-8 sequence) is held back until it completes.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6  # tokens of left context re-decoded each step


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def step(self, ids: list[int]) -> str:
        """`ids`: all generated ids so far. Returns the new complete text they add."""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        text = self._decode(ids[self._prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        new_text = text[len(prefix_text) :]
        self._read_offset = len(ids)
        self._prefix_offset = max(0, self._read_offset - _WINDOW)
        return new_text
