"""Stop rules, applied after each new token in priority order (docs/architecture.md). Pure Python.

1. timeout  2. length (max_new_tokens, never one more)  3. stop string / stop token id
4. EOS (every EOS id; ignore_eos continues)  5. repetition loop (same window N times in a row).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

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
        if now - seq.started_at > params.timeout_s:  # timed_out
            return "timeout"
        # stop strings are searched only where a match could end in the new text (_cut_at_stop_string)
        cut = bool(new_text) and bool(params.stop)
        if len(seq.output_ids) >= seq.max_new_tokens:
            if cut:
                self._cut_at_stop_string(seq, prev_len)  # length wins, but the text is still clean
            return "length"
        if is_stop_id or (cut and self._cut_at_stop_string(seq, prev_len)):
            return "stop"
        if is_eos and not params.ignore_eos:
            return "eos"
        if self._is_looping(seq.output_ids):
            return "repetition"
        return None

    def _cut_at_stop_string(self, seq: Sequence, prev_len: int) -> bool:
        """Cut the text at the earliest stop string (the first listed of those starting there), searching
        only text where a match could end in the new characters: the longest stop string's length - 1
        characters before them, and them. A match wholly in older text would have ended the sequence at
        the step it was completed in."""
        pattern, longest = _stop_pattern(tuple(seq.params.stop))  # (a list where a caller gave one)
        m = pattern.search(seq.text, max(0, prev_len - longest + 1))
        if m is None:
            return False
        seq.text = seq.text[: m.end()] if seq.params.include_stop_str_in_output else seq.text[: m.start()]
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
        # a period p needs ids[-1] == ids[-1 - p]: most steps have no such p, and are done in one `in`
        last, recent = ids[-1], ids[-w - 1 : -1]  # recent[-p] is ids[-1 - p]
        if last not in recent:
            return False
        tail = ids[-span:]
        return any(tail[p:] == tail[:-p] for p in range(1, w + 1) if recent[-p] == last)


@lru_cache(maxsize=1024)
def _stop_pattern(stop: tuple[str, ...]) -> tuple[re.Pattern[str], int]:
    """One regular expression for a request's stop strings (its leftmost match: the earliest, the first
    listed on a tie), and the longest's length."""
    return re.compile("|".join(map(re.escape, stop))), max(map(len, stop))
