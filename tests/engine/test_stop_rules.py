"""Stop rules in priority order, and clean incremental text (no special tokens, no broken characters)."""

from __future__ import annotations

import random

from fakes import make_seq

from tests.tiny_models import byte_tokenizer
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.stop_rules import StopRules

EOS = 2
RULES = StopRules([EOS], repetition_window=10, repetition_repeats=3)


def feed(seq, text_or_ids, rules=RULES, now=0.0):  # type: ignore[no-untyped-def]
    ids = [ord(c) for c in text_or_ids] if isinstance(text_or_ids, str) else text_or_ids
    reason = None
    for t in ids:
        reason = rules.append_token(seq, t, now)
        if reason is not None:
            break
    return reason


def test_length_stops_exactly_at_max_new_tokens() -> None:
    seq = make_seq("r", 3, 5)
    assert feed(seq, "abcdefgh") == "length"
    assert seq.output_ids == [ord(c) for c in "abcde"] and seq.text == "abcde"


def test_stop_string_across_token_boundaries_is_cut_or_kept() -> None:
    seq = make_seq("r", 3, 50, stop=["END", "zz"])
    assert feed(seq, "hello ENDmore") == "stop"
    assert seq.text == "hello " and len(seq.output_ids) == 9
    kept = make_seq("r", 3, 50, stop=["END"], include_stop_str_in_output=True)
    assert feed(kept, "hello ENDmore") == "stop" and kept.text == "hello END"


def test_earliest_stop_string_wins() -> None:
    seq = make_seq("r", 3, 50, stop=["cd", "bcde"])
    assert feed(seq, "abcdef") == "stop" and seq.text == "ab"


def test_stop_token_id_and_eos_are_counted_but_not_rendered() -> None:
    seq = make_seq("r", 3, 50, stop_token_ids=[ord("#")])
    assert feed(seq, "ab#cd") == "stop" and seq.text == "ab" and len(seq.output_ids) == 3
    eos = make_seq("r", 3, 50)
    assert feed(eos, [ord("a"), EOS, ord("b")]) == "eos" and eos.text == "a" and eos.output_ids == [97, EOS]


def test_ignore_eos_keeps_generating() -> None:
    seq = make_seq("r", 3, 4, ignore_eos=True)
    assert feed(seq, [97, EOS, 98, 99, 100]) == "length" and seq.text == "abc"


def test_length_outranks_stop_and_eos_on_the_same_token() -> None:
    seq = make_seq("r", 3, 2)
    assert feed(seq, [97, EOS]) == "length"
    stop = make_seq("r", 3, 4, stop=["cd"])
    assert feed(stop, "abcd") == "length" and stop.text == "ab"  # still cleaned


def test_timeout_outranks_everything_and_keeps_partial_text() -> None:
    seq = make_seq("r", 3, 50, timeout_s=1.0)
    assert feed(seq, "ab", now=0.5) is None
    assert feed(seq, [EOS], now=2.0) == "timeout" and seq.text == "ab"


def test_repetition_loop_detected_and_switchable() -> None:
    loop = "0123456789" * 3
    seq = make_seq("r", 3, 100)
    assert feed(seq, "x" + loop + "tail") == "repetition" and len(seq.output_ids) == 31
    short = make_seq("r", 3, 100)
    assert feed(short, "abc" * 10 + "d") == "repetition"  # period 3 does not divide the window
    off = make_seq("r", 3, 100)
    assert feed(off, loop * 2, rules=StopRules([EOS], 0, 3)) is None
    varied = make_seq("r", 3, 100)
    assert feed(varied, "the quick brown fox jumps over the lazy dog " * 2) is None


def test_incremental_detokenizer_never_emits_broken_characters() -> None:
    tok = byte_tokenizer()
    text = "数据 ok 你好🌟!"
    ids = tok(text).input_ids
    assert len(ids) > len(text)  # CJK and emoji span several byte tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_stripped_from_text() -> None:
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = [1, *tok("hi").input_ids, 2, 0]
    assert "".join(detok.step(ids[: i + 1]) for i in range(len(ids))) == "hi"


def test_loop_check_is_the_rule_as_written() -> None:
    """_is_looping's shortcut (no period can hold unless the last token is among the `window` before it)
    changes no answer: the rule as written, over random lists of loops of every period, broken or not."""
    rng = random.Random(5)
    seen = set()
    for window, repeats in ((10, 3), (4, 2), (1, 5), (0, 3), (3, 1)):
        rules = StopRules([EOS], window, repeats)
        span = window * repeats
        for _ in range(3000):
            unit = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
            ids = [rng.randrange(4) for _ in range(rng.randint(0, 20))] + unit * rng.randint(1, 8)
            if ids and rng.random() < 0.3:
                ids[rng.randrange(len(ids))] = 9
            tail = ids[-span:]
            want = window > 0 and repeats >= 2 and len(ids) >= span
            want = want and any(tail[p:] == tail[:-p] for p in range(1, window + 1))
            assert rules._is_looping(ids) == want, (window, repeats, ids)
            seen.add(want)
    assert seen == {True, False}


class Chunks:
    """A detokenizer stand-in: the i-th token's text is chunks[i]."""

    def __init__(self, chunks: list[str]) -> None:
        self.chunks = chunks

    def step(self, ids: list[int]) -> str:
        return self.chunks[len(ids) - 1]


def stop_as_written(chunks: list[str], stop: list[str], keep: bool) -> tuple[int, str] | None:
    """The stop-string rule as first written: each string searched from len(s) - 1 characters before the
    new text, the earliest match (the first listed on a tie) cut. -> (tokens taken, text), None: no stop."""
    text = ""
    for n, chunk in enumerate(chunks, 1):
        prev, text = len(text), text + chunk
        best: tuple[int, str] | None = None
        for s in stop:
            idx = text.find(s, max(0, prev - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if chunk and best is not None:
            return n, text[: best[0] + len(best[1])] if keep else text[: best[0]]
    return None


def test_stop_strings_cut_where_the_rule_as_written_cuts() -> None:
    """One search over the tail (the longest stop string's reach) finds what a search per string finds:
    random chunked texts of a small alphabet, stop strings that overlap, share prefixes, contain each other,
    include regular-expression characters."""
    rng = random.Random(9)
    alphabet = "ab.*中 "
    stops = 0
    for _ in range(4000):
        chunks = [
            "".join(rng.choice(alphabet) for _ in range(rng.choice((0, 1, 1, 2, 3, 5)))) for _ in range(30)
        ]
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))
        ]
        keep = rng.random() < 0.5
        seq = make_seq("r", 3, 100, stop=stop, include_stop_str_in_output=keep)
        seq.detokenizer = Chunks(chunks)  # type: ignore[assignment]
        reason = feed(seq, list(range(3, 3 + len(chunks))), rules=StopRules([], 0, 0))
        want = stop_as_written(chunks, stop, keep)
        got = None if reason is None else (len(seq.output_ids), seq.text)
        assert got == want, (chunks, stop, keep)
        stops += want is not None
    assert 1000 < stops < 3900
