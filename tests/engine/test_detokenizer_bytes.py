"""IncrementalDetokenizer's tables against DecodeDetokenizer, the decode-based definition of the text: the
same text at every step, byte for byte, for SmolLM2's byte-level BPE, SentencePiece decoders built here
(byte fallback, Llama's leading-space Strip, Metaspace), and the tokenizers that keep the decode path.
"""

from __future__ import annotations

import dataclasses
import random
from functools import cache
from typing import Any

import pytest
from fakes import CharTokenizer, make_seq

from tests.tiny_models import BYTE_OFFSET, THINK, byte_tokenizer, think_tokenizer
from worker.engine import detokenizer as detok_module
from worker.engine.detokenizer import (
    DecodeDetokenizer,
    DetokenizerPlan,
    IncrementalDetokenizer,
    build_plan,
    detokenizer_plan,
)
from worker.engine.reasoning import ReasoningMarkers
from worker.engine.stop_rules import StopRules

FFFD = "\ufffd"
MULTILINGUAL = [
    "Grüße aus Köln, señor! Ça va? naïve café",
    "数据科学和机器学习。你好，世界！",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n    return x ** 2  # tabs\tand   spaces\n\n",
    "ελληνικά, русский, עברית, العربية, हिन्दी, 日本語のテキスト",
    "a literal replacement character \ufffd in the middle, and \ufffd\ufffd twice",
    "   leading spaces, trailing spaces   ",
]


def steps(detok: Any, ids: list[int]) -> list[str]:
    """What `detok` emits at each step of `ids` (the engine's calls: the list grows by one each time)."""
    grown: list[int] = []
    out = []
    for t in ids:
        grown.append(t)
        out.append(detok.step(grown))
    return out


def first_difference(tok: Any, seqs: list[list[int]], plan: DetokenizerPlan | None = None) -> Any:
    """The first step where IncrementalDetokenizer (with `plan`, else the tokenizer's) and DecodeDetokenizer
    emit different text: (ids so far, decode's, the table's), or None."""
    plan = plan or detokenizer_plan(tok)
    for ids in seqs:
        want = steps(DecodeDetokenizer(tok), ids)
        got = steps(IncrementalDetokenizer(tok, plan), ids)
        if want != got:
            i = next(i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g)
            return ids[: i + 1], want[i], got[i]
    return None


def random_seqs(rng: random.Random, pools: list[list[int]], count: int, longest: int = 24) -> list[list[int]]:
    """`count` id sequences, each id from a pool picked at random (the first pool twice as often)."""
    picks = [0, *range(len(pools))]
    return [
        [rng.choice(pools[rng.choice(picks)]) for _ in range(rng.randint(1, longest))] for _ in range(count)
    ]


# ---- SmolLM2: byte-level BPE ------------------------------------------------------------------------------


@cache
def smol() -> Any:
    from transformers import AutoTokenizer

    from worker.models.resolve import resolve_checkpoint

    return AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))


def smol_pools() -> list[list[int]]:
    tok = smol()
    size = len(tok)
    plan = detokenizer_plan(tok)
    held = [i for i in range(size) if plan.texts[i] is None]  # bytes of a longer character, U+FFFD
    multibyte = sorted({t for text in MULTILINGUAL for t in tok(text).input_ids})
    special = sorted(tok.added_tokens_decoder)
    return [list(range(size)), held, multibyte, special, [size, size + 5]]  # (ids past the vocabulary)


def test_smollm2_takes_the_byte_table() -> None:
    plan = detokenizer_plan(smol())
    assert plan.kind == "bytes" and IncrementalDetokenizer(smol()).kind == "bytes"
    assert sum(t is None for t in plan.texts) > 100  # tokens of part of a character exist (and are held)


def test_smollm2_random_ids_give_the_decode_text_at_every_step() -> None:
    seqs = random_seqs(random.Random(52), smol_pools(), 3000)
    assert first_difference(smol(), seqs) is None


def test_smollm2_real_text_comes_back_whole() -> None:
    tok = smol()
    for text in MULTILINGUAL:
        ids = tok(text).input_ids
        assert first_difference(tok, [ids]) is None
        assert "".join(steps(IncrementalDetokenizer(tok), ids)) == text
        assert all(not p.endswith(FFFD) or "\ufffd" in text for p in steps(IncrementalDetokenizer(tok), ids))


def test_a_genuine_replacement_character_waits_for_the_next_one() -> None:
    """Today's rule, kept: text ending in U+FFFD is held back, a genuine one too; it comes out with the next
    character, and a sequence that ends on it never shows it."""
    tok = smol()
    for detok in (DecodeDetokenizer, IncrementalDetokenizer):
        ids = tok("ok\ufffd!").input_ids
        out = steps(detok(tok), ids)
        assert "".join(out) == "ok\ufffd!" and out[-1].startswith(FFFD)
        assert "".join(steps(detok(tok), tok("ok\ufffd").input_ids)) == "ok"


def test_the_random_ids_catch_a_dropped_byte() -> None:
    """A table that loses one byte of one token (held or complete on its own) differs within the random
    sequences: the test above would fail for it."""
    tok = smol()
    plan = detokenizer_plan(tok)
    seqs = random_seqs(random.Random(52), smol_pools(), 3000)
    held = next(i for i in range(len(tok)) if plan.texts[i] is None and len(plan.raw[i]) > 1)
    raw = list(plan.raw)
    raw[held] = raw[held][:-1]
    assert first_difference(tok, seqs, dataclasses.replace(plan, raw=raw)) is not None
    whole = tok("é").input_ids[0]  # a complete character on its own: the fast path's text
    texts = list(plan.texts)
    texts[whole] = ""
    assert first_difference(tok, seqs, dataclasses.replace(plan, texts=texts)) is not None


def test_pythons_replacement_is_rusts() -> None:
    """The byte table's premise: Python's "replace" decoding of bytes is Hugging Face's (Rust's
    from_utf8_lossy), at every kind of invalid UTF-8; and the stepwise text is decode's."""
    tok = byte_tokenizer()
    rng = random.Random(7)
    # ASCII, continuation bytes, overlong / surrogate / out-of-range leads, 2-, 3-, 4-byte leads, invalid bytes
    alphabet = [
        0x41,
        0x7F,
        0x80,
        0x8F,
        0x90,
        0x9F,
        0xA0,
        0xBF,
        0xC0,
        0xC1,
        0xC2,
        0xDF,
        0xE0,
        0xE1,
        0xED,
        0xEF,
    ]
    alphabet += [0xF0, 0xF1, 0xF4, 0xF5, 0xFE, 0xFF]
    cases = [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(5000)]
    ids = [[b + BYTE_OFFSET for b in case] for case in cases]
    rust = tok.backend_tokenizer.decode_batch(ids, skip_special_tokens=True)
    assert [c.decode("utf-8", "replace") for c in cases] == rust
    assert detokenizer_plan(tok).kind == "bytes"
    assert first_difference(tok, ids[:1500]) is None


# ---- SentencePiece decoders, built offline ----------------------------------------------------------------

PIECES = [
    "▁",
    "▁▁",
    "▁the",
    "▁Hello",
    "▁world",
    "He",
    "llo",
    "▁a",
    "é",
    "中",
    "文",
    "▁é",
    "▁中",
    ".",
    ",",
    "!",
]
PIECES += [
    "\n",
    "\ufffd",
    "▁\ufffd",
    *"abcdefghijklmnopqrstuvwxyz",
    *(f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"),
]
SP_SPECIALS = ["<unk>", "<s>", "</s>"]
SP_TEXTS = [
    "Hello world",
    " the 中文 é 😀😀😀 ok",
    "  a  b",
    "x\ufffdy \ufffd",
    "Grüße, ça va? 数据 🎉🇫🇷 the end.\n\nthe",
]


def sentencepiece_tokenizer(decoder: str) -> Any:
    """A Unigram SentencePiece-style tokenizer with byte fallback (ids 3..258 are <0x00>..<0xFF>), an added
    token that is not special, and one of these decoders: "llama" (Replace ▁, ByteFallback, Fuse, Strip one
    leading space: Llama 2, Mistral), "gemma" (no Strip), "metaspace" (Metaspace's first-token rule,
    ByteFallback, Fuse), or an unsupported one ("replace_fused": a Replace over the fused text;
    "wordpiece")."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [(s, 0.0) for s in SP_SPECIALS] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [(p, -1.0 - 1.0 / len(p) - i / 100) for i, p in enumerate(PIECES)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    space = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if decoder == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [
                decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                decoders.ByteFallback(),
                decoders.Fuse(),
            ]
        )
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = {
            "llama": decoders.Sequence([*space, decoders.Strip(" ", 1, 0)]),
            "gemma": decoders.Sequence(space),
            "replace_fused": decoders.Sequence([*space, decoders.Replace("ab", "-")]),
            "wordpiece": decoders.WordPiece(),
        }[decoder]
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.add_special_tokens({"additional_special_tokens": SP_SPECIALS})
    fast.add_tokens(["<tool>"])  # added, not special: decodes to its content
    return fast


def sp_pools(tok: Any) -> list[list[int]]:
    size = len(tok)
    ids = tok.convert_tokens_to_ids
    spaces = ids(["▁", "▁▁"])
    return [
        list(range(size)),
        list(range(3, 259)),
        [0, 1, 2],
        spaces,
        ids(["▁Hello", "▁a", "\ufffd"]),
        [size + 1],
    ]


SUPPORTED = ["llama", "gemma", "metaspace"]


@pytest.mark.parametrize("decoder", SUPPORTED)
def test_sentencepiece_takes_the_piece_table(decoder: str) -> None:
    plan = detokenizer_plan(sentencepiece_tokenizer(decoder))
    assert plan.kind == "pieces", plan.reason


@pytest.mark.parametrize("decoder", SUPPORTED)
def test_sentencepiece_random_ids_give_the_decode_text_at_every_step(decoder: str) -> None:
    tok = sentencepiece_tokenizer(decoder)
    assert first_difference(tok, random_seqs(random.Random(52), sp_pools(tok), 2500)) is None


@pytest.mark.parametrize("decoder", SUPPORTED)
def test_sentencepiece_text_at_every_step(decoder: str) -> None:
    tok = sentencepiece_tokenizer(decoder)
    for text in SP_TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        assert first_difference(tok, [ids, [1, *ids, 2, *ids]]) is None


def test_the_leading_space_rule_is_todays() -> None:
    """Llama's Strip and Metaspace take the space off the text's first token: a sequence's first token
    ("▁Hello" -> "Hello"), after any number of skipped special tokens too; later spaces stay, even after
    more than the window's worth of special tokens (the window before the new ids still holds the last
    emitted token). A lone space first: Strip takes one space of the two, Metaspace the first token's."""
    for decoder in ("llama", "metaspace"):
        tok = sentencepiece_tokenizer(decoder)
        hello, world, space, eos = tok.convert_tokens_to_ids(["▁Hello", "▁world", "▁", "</s>"])
        for ids, text in (
            ([hello, world], ["Hello", " world"]),
            ([*[eos] * 8, hello, world], [*[""] * 8, "Hello", " world"]),
            ([hello, *[eos] * 8, world], ["Hello", *[""] * 8, " world"]),
            ([space, hello], ["", " Hello"]),
        ):
            for detok in (DecodeDetokenizer, IncrementalDetokenizer):
                assert steps(detok(tok), ids) == text, (decoder, detok, ids)


def test_a_byte_fallback_run_is_decoded_as_today() -> None:
    """DecodeDetokenizer's window (6 tokens) cuts into a long run of byte-fallback tokens, and ByteFallback
    then turns the whole run into U+FFFD per byte: the third emoji of three comes out as four U+FFFD.
    IncrementalDetokenizer decodes such steps the same way, so the text stays byte for byte today's."""
    tok = sentencepiece_tokenizer("llama")
    ids = tok("😀😀😀 ok", add_special_tokens=False).input_ids
    for detok in (DecodeDetokenizer, IncrementalDetokenizer):
        assert "".join(steps(detok(tok), ids)) == "😀😀" + FFFD * 4 + " ok"


def test_the_random_ids_catch_a_wrong_leading_space() -> None:
    """A table whose anchors start out in place (no decode for a sequence's first tokens) keeps the first
    token's space: the random sequences find it."""
    tok = sentencepiece_tokenizer("llama")
    seqs = random_seqs(random.Random(52), sp_pools(tok), 2500)

    class Eager(IncrementalDetokenizer):
        def __init__(self, tokenizer: Any, plan: DetokenizerPlan | None = None) -> None:
            super().__init__(tokenizer, plan)
            self._anchor_at_r = 0

    want = [steps(DecodeDetokenizer(tok), ids) for ids in seqs]
    assert [steps(Eager(tok), ids) for ids in seqs] != want
    assert [steps(IncrementalDetokenizer(tok), ids) for ids in seqs] == want


def counting(decode: Any, calls: list[int]) -> Any:
    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return decode(*a, **k)

    return counted


def test_the_tables_skip_hugging_faces_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the tables: SmolLM2's text never calls the tokenizer's decode; a SentencePiece text
    calls it for its first emission (the leading-space rule) and the steps a byte-fallback token is in
    the window of, not per token."""
    calls: list[int] = []
    cases = [
        (smol(), MULTILINGUAL[1] + MULTILINGUAL[0], 0),
        (sentencepiece_tokenizer("llama"), "the a b c Hello world " * 10 + "中 é", 2),
    ]
    for tok, text, most in cases:
        plan = detokenizer_plan(tok)
        ids = tok(text, add_special_tokens=False).input_ids
        want = steps(DecodeDetokenizer(tok), ids)
        inner = tok.decode
        calls.clear()
        monkeypatch.setattr(tok, "decode", counting(inner, calls))
        assert steps(IncrementalDetokenizer(tok, plan), ids) == want and len(ids) > 40
        assert len(calls) <= most, (len(calls), len(ids))
        monkeypatch.undo()
    tok = sentencepiece_tokenizer("llama")
    ids = tok("x " + "😀" * 4 + " the a b c d e f g", add_special_tokens=False).input_ids
    plan = detokenizer_plan(tok)
    monkeypatch.setattr(tok, "decode", counting(tok.decode, calls))
    calls.clear()
    steps(IncrementalDetokenizer(tok, plan), ids)
    assert 2 < len(calls) <= 2 * (1 + 16 + 6 + 1)  # the first emission, the run and 6 tokens after it


# ---- the decode path, where no table stands for the tokenizer ---------------------------------------------


def own_decode_tokenizer() -> Any:
    """A fast tokenizer of a class whose decode is its own (the table would not see what it does)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _decode(
            self,
            token_ids: int | list[int],
            skip_special_tokens: bool = False,
            clean_up_tokenization_spaces: bool | None = None,
            **kwargs: Any,
        ) -> str:
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces).upper()

    inner = Tokenizer.from_str(byte_tokenizer().backend_tokenizer.to_str())
    return Shouting(tokenizer_object=inner)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (CharTokenizer, "not a fast"),
        (lambda: sentencepiece_tokenizer("replace_fused"), "Replace after Fuse"),
        (lambda: sentencepiece_tokenizer("wordpiece"), "WordPiece"),
        (own_decode_tokenizer, "decodes in a way of its own"),
    ],
)
def test_other_tokenizers_keep_the_decode_path(make: Any, why: str) -> None:
    tok = make()
    plan = detokenizer_plan(tok)
    assert plan.kind == "decode" and why in plan.reason, plan.reason
    assert IncrementalDetokenizer(tok).kind == "decode"
    size = 300
    seqs = random_seqs(random.Random(3), [list(range(3, size)), [0, 1, 2]], 200)
    assert first_difference(tok, seqs) is None


def test_a_table_that_fails_its_check_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is checked against the tokenizer's decode of every token and of random sequences: a wrong
    table (here one byte of the emoji's first token dropped) is refused, with the difference."""
    tok = byte_tokenizer()
    right = detok_module._bytes_plan

    def wrong(listed: list[str | None]) -> DetokenizerPlan:
        plan = right(listed)
        raw = list(plan.raw)
        raw[0xF0 + BYTE_OFFSET] = b""
        return dataclasses.replace(plan, raw=raw)

    monkeypatch.setattr(detok_module, "_bytes_plan", wrong)
    plan = build_plan(tok)
    assert (
        plan.kind == "decode" and "failed its check" in plan.reason and str(0xF0 + BYTE_OFFSET) in plan.reason
    )


def test_a_plan_is_built_once_per_tokenizer() -> None:
    tok = byte_tokenizer()
    assert detokenizer_plan(tok) is detokenizer_plan(tok)
    before = detokenizer_plan(tok)
    tok.add_tokens(["<new>"])
    after = detokenizer_plan(tok)
    assert after is not before and after.raw[len(tok) - 1] == b"<new>"


# ---- stop strings and reasoning, through the stop rules ---------------------------------------------------


def run_rules(tok: Any, ids: list[int], detok: type, **params: Any) -> tuple[Any, str, int]:
    seq = make_seq("r", 3, len(ids) + 5, **params)
    seq.detokenizer = detok(tok)
    rules = StopRules([], repetition_window=0, repetition_repeats=0)
    reason = None
    for t in ids:
        if (reason := rules.append_token(seq, t, 0.0)) is not None:
            break
    return reason, seq.text, len(seq.output_ids)


@pytest.mark.parametrize("name", ["smollm2", "llama"])
def test_stop_strings_across_tokens_end_as_today(name: str) -> None:
    """Stop strings cut at the same token and text with either detokenizer, kept or cut
    (include_stop_str_in_output): strings that span tokens, start a text, hold multi-byte characters."""
    tok = smol() if name == "smollm2" else sentencepiece_tokenizer("llama")
    rng = random.Random(11)
    texts = MULTILINGUAL if name == "smollm2" else SP_TEXTS
    checked = 0
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        full = "".join(steps(DecodeDetokenizer(tok), ids))
        for _ in range(12):
            a = rng.randrange(len(full))
            stop = full[a : a + rng.randint(1, 6)]
            for keep in (False, True):
                params: dict[str, Any] = {"stop": (stop, "never-there"), "include_stop_str_in_output": keep}
                want = run_rules(tok, ids, DecodeDetokenizer, **params)
                assert run_rules(tok, ids, IncrementalDetokenizer, **params) == want
                checked += want[0] == "stop"
    assert checked > 50


def test_reasoning_text_and_answer_as_today() -> None:
    """A reasoning model's thinking goes to reasoning_text through its own detokenizer; both texts match."""
    tok = think_tokenizer()
    markers = ReasoningMarkers.detect(tok, "qwen3", "auto")
    assert markers is not None
    think, end = THINK, THINK + 1
    body = tok("pensée 思考 🤔", add_special_tokens=False).input_ids
    answer = tok("réponse: 答案 ✅", add_special_tokens=False).input_ids
    ids = [think, *body, end, *answer]
    out = []
    for detok in (DecodeDetokenizer, IncrementalDetokenizer):
        seq = make_seq("r", 3, 100)
        seq.detokenizer, seq.reasoning_detokenizer = detok(tok), detok(tok)  # type: ignore[assignment]
        seq.reasoning = markers.state([1, 2], None)
        rules = StopRules([], 0, 0)
        for t in ids:
            assert rules.append_token(seq, t, 0.0) is None
        out.append((seq.reasoning_text, seq.text))
    assert out[0] == out[1] == ("pensée 思考 🤔", "réponse: 答案 ✅")


# ---- text that waits: catch_up and the stop rules' fast path ----------------------------------------------


def caught_up(detok: Any, ids: list[int], rng: random.Random) -> str:
    """`ids` taken as the engine takes a deferred sequence's: runs of ids unseen, then a catch_up, or a catch_up
    to the id before and a step (append_token's settle_text, then its step)."""
    out: list[str] = []
    grown: list[int] = []
    for t in ids:
        grown.append(t)
        if rng.random() < 0.3:
            out.append(detok.catch_up(grown))
        elif rng.random() < 0.3:
            out.append(detok.catch_up(grown[:-1]))
            out.append(detok.step(grown))
    out.append(detok.catch_up(grown))
    return "".join(out)


@pytest.mark.parametrize("name", ["smollm2", "llama", "gemma"])
def test_catch_up_gives_the_text_of_every_step(name: str) -> None:
    """A sequence whose text waits (Sequence.defer_text) gets, whenever it catches up, exactly what stepping
    through every id would have emitted: held bytes, U+FFFD, special and unknown ids included."""
    tok = smol() if name == "smollm2" else sentencepiece_tokenizer(name)
    pools = smol_pools() if name == "smollm2" else sp_pools(tok)
    rng = random.Random(7)
    for ids in random_seqs(rng, pools, 1500, longest=40):
        want = "".join(steps(IncrementalDetokenizer(tok), ids))
        assert caught_up(IncrementalDetokenizer(tok), ids, rng) == want, ids


def drive(tok: Any, ids: list[int], fast: bool, eos: list[int], **params: Any) -> tuple[Any, str, list[int]]:
    """Feed `ids` to one sequence through the stop rules: append_token alone, or append_fast with
    append_token for the tokens it leaves (the engine's decode rows); -> (reason, text, output ids)."""
    seq = make_seq("r", 3, params.pop("max_new", len(ids) + 5), **params)
    seq.detokenizer = IncrementalDetokenizer(tok)
    rules = StopRules(eos, repetition_window=4, repetition_repeats=3)
    rules.prepare(seq)
    reason = None
    for i, t in enumerate(ids):
        if fast and i:  # (a sequence's first token comes from its prefill step: append_token)
            left = rules.append_fast([seq], [t], 0.0)
            reason = left[0][1] if left else None
            if left and reason is None:
                reason = rules.append_token(seq, t, 0.0)
        else:
            reason = rules.append_token(seq, t, 0.0)
        if reason is not None:
            break
    seq.settle_text()
    return reason, seq.text, seq.output_ids


@pytest.mark.parametrize("name", ["smollm2", "llama"])
def test_the_fast_path_ends_and_renders_as_the_full_rules(name: str) -> None:
    """append_fast (and the deferred text it leaves) against append_token alone, on random ids with EOS, stop
    ids, stop strings that span tokens, ignore_eos, max_new_tokens and loops: the same finish reason, text
    and tokens, at the same token."""
    tok = smol() if name == "smollm2" else sentencepiece_tokenizer("llama")
    pools = smol_pools() if name == "smollm2" else sp_pools(tok)
    rng = random.Random(23)
    eos = [pools[0][rng.randrange(len(pools[0]))], 2]
    seen: set[Any] = set()
    for ids in random_seqs(rng, pools, 1200, longest=30):
        if rng.random() < 0.3:  # a loop the repetition rule ends
            ids = ids[:5] + ids[5:9] * 4
        if rng.random() < 0.2:
            ids = [*ids[:-1], rng.choice(eos)]
        full = "".join(steps(IncrementalDetokenizer(tok), ids))
        params: dict[str, Any] = {"ignore_eos": rng.random() < 0.3}
        if rng.random() < 0.3:
            params["stop_token_ids"] = (rng.choice(ids),)
        if full and rng.random() < 0.5:
            a = rng.randrange(len(full))
            params["stop"] = (full[a : a + rng.randint(1, 4)], "never-there")
            params["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.3:
            params["max_new"] = rng.randint(1, len(ids))
        want = drive(tok, ids, False, eos, **dict(params))
        assert drive(tok, ids, True, eos, **dict(params)) == want, (ids, params)
        seen.add(want[0])
    assert seen >= {None, "stop", "eos", "length", "repetition"}
