"""Stop rules, applied after each new token in priority order (docs/architecture.md). Pure Python.

1. timeout  2. length (max_new_tokens, never one more)  3. stop string / stop token id
4. EOS (every EOS id; ignore_eos continues)  5. repetition loop (same window N times in a row).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from functools import lru_cache

from worker.engine.detokenizer import ending_bytes_table
from worker.engine.request import FinishReason
from worker.engine.sequence import Sequence

# Sequence.deadline is its timeout this much early: append_fast leaves a token past it to append_token,
# whose check (now - started_at > timeout_s) is the rule; the margin covers the two sums' rounding.
DEADLINE_MARGIN = 1e-3
_FFFD = "\ufffd"


class StopRules:
    def __init__(self, eos_token_ids: Iterable[int], repetition_window: int, repetition_repeats: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.window = repetition_window
        self.repeats = repetition_repeats
        self._ending: dict[
            tuple[int, frozenset[int]], tuple[object, bytes]
        ] = {}  # (plan, last bytes) -> table
        self._sets: dict[tuple[object, ...], tuple[frozenset[int], frozenset[int], frozenset[str]]] = {}

    def timed_out(self, seq: Sequence, now: float) -> bool:
        return now - seq.started_at > seq.params.timeout_s

    def prepare(self, seq: Sequence) -> None:
        """Set a new sequence's fast-path fields (Sequence.fast): which tokens take the full rules, which are
        never rendered, from when its timeout may apply, and whether its text may wait."""
        p = seq.params
        key = (tuple(p.stop_token_ids), p.ignore_eos, tuple(p.stop))  # (a caller may give lists)
        sets = self._sets.get(key)
        if sets is None:  # one set per distinct request shape, shared: the step's loop reads them from cache
            stop_ids = frozenset(p.stop_token_ids)
            silent = stop_ids if p.ignore_eos else stop_ids | self.eos_token_ids
            sets = self._sets[key] = (self.eos_token_ids | stop_ids, silent, frozenset(s[-1] for s in p.stop))
        seq.ends_on, seq.silent_ids, seq.stop_ends = sets
        # (no timeout: the one infinity, not a float object per sequence for the step's loop to read)
        seq.deadline = seq.started_at + p.timeout_s - DEADLINE_MARGIN if p.timeout_s != math.inf else math.inf
        seq.fast = (
            seq.reasoning is None
            and seq.matcher is None
            and not seq.scores_labels
            and not p.logprobs
            and not seq.ranked
            and seq.pooling is None
            # (penalties read the tokens generated: a step could not run before the last one's are taken)
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
        )
        seq.defer_text = seq.fast and seq.detokenizer.kind == "bytes"
        if seq.defer_text and p.stop:
            ends = seq.stop_ends
            if (
                _FFFD in ends
            ):  # a character the decoder makes of invalid bytes: no byte of its own to watch for
                seq.defer_text = False
            else:
                last = frozenset(c.encode()[-1] for c in ends)
                plan = seq.detokenizer.plan
                key2 = (id(plan), last)
                table = self._ending.get(key2)
                if table is None or table[0] is not plan:
                    table = self._ending[key2] = (plan, ending_bytes_table(plan, last))
                seq.stop_bytes = table[1]

    def append_fast(
        self, seqs: list[Sequence], tokens: list[int], now: float
    ) -> list[tuple[int, FinishReason | None]]:
        """Decode rows' tokens, each appended here where only a stop string or the repetition rule can end
        its sequence (what most tokens of a plain request are: append_token's rules in its order, less the
        ones that cannot apply). -> (index, reason) for the rows it ended, and (index, None) for the rows it
        left alone, whose token append_token must take (the caller's, with what else the token needs)."""
        out: list[tuple[int, FinishReason | None]] = []
        w, span = self.window, self.window * self.repeats
        if w == 0 or self.repeats < 2:
            span = 1 << 62  # the rule is off
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            ids = seq.output_ids
            if (
                not seq.fast
                or token in seq.ends_on
                or now > seq.deadline
                or len(ids) + 1 >= seq.max_new_tokens
            ):
                out.append((i, None))
                continue
            ids.append(token)
            if seq.defer_text:
                stop_bytes = seq.stop_bytes
                if stop_bytes is None:
                    pass
                elif seq.text_held or token >= len(stop_bytes) or stop_bytes[token]:
                    # A stop string may end here (or in the text the detokenizer held back at such an id):
                    # the text catches up, and is searched from the end of what it had.
                    text = seq.text
                    seq.text = ""
                    prev_len = len(text)
                    text += seq.detokenizer.catch_up(ids)
                    seq.text = text
                    seq.text_held = seq.detokenizer.holding
                    if len(text) > prev_len and self._cut_at_stop_string(seq, prev_len):
                        out.append((i, "stop"))
                        continue
            else:
                new_text = seq.detokenizer.step(ids)
                if new_text:
                    text = seq.text
                    seq.text = ""  # the local holds the only reference: += grows the string in place
                    prev_len = len(text)
                    text += new_text
                    seq.text = text
                    # a stop string completed here ends in the new text: with one of their last characters
                    if not seq.stop_ends.isdisjoint(new_text) and self._cut_at_stop_string(seq, prev_len):
                        out.append((i, "stop"))
                        continue
            if len(ids) >= span and token in ids[-w - 1 : -1] and self._is_looping(ids):
                out.append((i, "repetition"))
        return out

    def append_token(self, seq: Sequence, token: int, now: float) -> FinishReason | None:
        """Add one sampled token to `seq` (ids and clean text); return why it must finish, if it must.

        A reasoning model's thinking (reasoning.py) meets every rule but stop strings, which apply to the
        answer only: its tokens render into reasoning_text, its markers nowhere."""
        seq.settle_text()  # a deferred text catches up before this token's rules read it
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
            text = seq.reasoning_text
            seq.reasoning_text = ""  # (as below)
            text += seq.reasoning_detokenizer.step(seq.reasoning_ids)
            seq.reasoning_text = text
        text = seq.text
        seq.text = (
            ""  # the local holds the only reference: += grows the string in place, not a copy per token
        )
        prev_len = len(text)
        text += new_text
        seq.text = text
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
