"""Stop rules, applied after each new token in priority order (docs/architecture.md). Pure Python.

1. timeout  2. length (max_new_tokens, never one more)  3. stop string / stop token id
4. EOS (every EOS id; ignore_eos continues)  5. repetition loop (same window N times in a row).
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.engine.request import FinishReason
from worker.engine.sequence import Sequence


class StopRules:
    def __init__(self, eos_token_ids: Iterable[int], repetition_window: int, repetition_repeats: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.window = repetition_window
        self.repeats = repetition_repeats

    def timed_out(self, seq: Sequence, now: float) -> bool:
        return now - seq.started_at > seq.params.timeout_s

    def append_token(self, seq: Sequence, token: int, now: float) -> FinishReason | None:
        """Add one sampled token to `seq` (ids and clean text); return why it must finish, if it must.

        A reasoning model's thinking (reasoning.py) meets every rule but stop strings, which apply to the
        answer only: its tokens render into reasoning_text, its markers nowhere."""
        seq.output_ids.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
        params = seq.params
        is_eos = token in self.eos_token_ids
        is_stop_id = token in params.stop_token_ids
        role = "answer" if seq.reasoning is None else seq.reasoning.feed(token)
        # The final EOS / stop token is counted but never rendered (it is usually a special token).
        silent = (is_eos and not params.ignore_eos) or is_stop_id
        new_text = ""
        if role == "answer" and not silent:
            new_text = seq.detokenizer.step(seq.answer_ids)
        elif role == "reasoning" and not silent and seq.reasoning_detokenizer is not None:
            seq.reasoning_ids.append(token)
            seq.reasoning_text += seq.reasoning_detokenizer.step(seq.reasoning_ids)
        prev_len = len(seq.text)
        seq.text += new_text
        if self.timed_out(seq, now):
            return "timeout"
        if len(seq.output_ids) >= seq.max_new_tokens:
            if new_text:
                self._cut_at_stop_string(seq, prev_len)  # length wins, but the text is still clean
            return "length"
        if is_stop_id or (new_text and self._cut_at_stop_string(seq, prev_len)):
            return "stop"
        if is_eos and not params.ignore_eos:
            return "eos"
        if self._is_looping(seq.output_ids):
            return "repetition"
        return None

    def _cut_at_stop_string(self, seq: Sequence, prev_len: int) -> bool:
        """Search only text that could contain a match ending in the new characters; cut there."""
        best: tuple[int, str] | None = None
        for s in seq.params.stop:
            start = max(0, prev_len - len(s) + 1)
            idx = seq.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        seq.text = seq.text[: idx + len(s)] if seq.params.include_stop_str_in_output else seq.text[:idx]
        return True

    def _is_looping(self, ids: list[int]) -> bool:
        """The last window × repeats tokens repeat one pattern of period <= window.

        Period == window is the literal rule (the same 10-token window three times in a row); shorter
        periods catch tight loops (a 3-token emoji repeated) whose period does not divide the window.
        """
        w, n = self.window, self.repeats
        span = w * n
        if w == 0 or n < 2 or len(ids) < span:
            return False
        tail = ids[-span:]
        return any(tail[p:] == tail[:-p] for p in range(1, w + 1))
