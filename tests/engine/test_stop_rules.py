"""Stop rules in priority order, and clean incremental text (no special tokens, no broken characters)."""

from __future__ import annotations

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
