"""Incremental detokenisation: emits only complete characters, never special tokens.

The text is the decode-based scheme's (DecodeDetokenizer, vLLM's): a step decodes a short window of ids that
starts a few tokens before the last emission twice, without and with the ids new since then, and emits the
difference, unless the window's text ends in U+FFFD (an incomplete UTF-8 sequence; a genuine U+FFFD is held
back the same way, until a character follows it) or the new ids add nothing. So multi-token characters (CJK,
emoji) and word-initial spaces come out right. Two Hugging Face decodes per token were the largest host cost
of a decode step; IncrementalDetokenizer gives the same text, byte for byte, from a table of the tokenizer's
tokens built once per tokenizer (`detokenizer_plan`, checked against the tokenizer's own decoding):

- "bytes", a byte-level BPE (GPT-2's decoder: Llama 3, Qwen, SmolLM2): a token stands for its bytes, and a
  list of ids decodes to their bytes joined, invalid UTF-8 replaced by U+FFFD per maximal invalid
  subsequence (Rust's from_utf8_lossy, Python's "replace"). The window before the new ids ends on a
  complete character (the last emission's text did not end in U+FFFD), so the window's difference is the
  text of the new ids' bytes alone: each sequence feeds them to an incremental UTF-8 decoder and emits its
  text once that is not empty and ends neither in U+FFFD nor in incomplete bytes. A token whose bytes are
  complete characters on their own (most) is its text when nothing is held.
- "pieces", a SentencePiece decoder (Replace("▁", " "), ByteFallback, Fuse, a leading Strip: Llama 2,
  Mistral, Gemma; Metaspace): a token stands for its text with "▁" as a space. Where the window before the
  new ids holds an anchor (a token with a character the Strip would not remove) and the window no
  byte-fallback token (<0x..>), the decoder's rules for the text's start (Strip's space, Metaspace's first
  token) act before the anchor alike with and without the new ids, so the difference is the new tokens'
  texts joined. Other steps (a sequence's first tokens, a byte-fallback run in the window: ByteFallback
  decodes a run whole, or a U+FFFD per byte) decode the window as DecodeDetokenizer does. (So they keep
  its flaw: a window that starts inside a long run, three emoji in a row, turns the run's rest into U+FFFD.)
- "decode": DecodeDetokenizer itself, for a tokenizer the table cannot stand for (a slow or custom tokenizer,
  a decode of its own, another decoder: WordPiece, Replace after Fuse, a Strip at the end, ...), or whose
  plan failed its check. The plan's `reason` says which.

Special tokens (those the tokenizer marks special) are skipped, as skip_special_tokens=True skips them;
added tokens that are not special decode to their content, through the decoder like any other token.
Normalizers act on encoding only (an added token's normalized content is what id_to_token gives, and
decode), and clean_up_tokenization_spaces is never asked for.
"""

from __future__ import annotations

import codecs
import gc
import json
import random
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

_WINDOW = 6  # tokens of left context re-decoded each step (DecodeDetokenizer's)
_FFFD = "\ufffd"
# ByteFallback's byte tokens: 6 bytes, "<0x", what Rust's u8::from_str_radix(_, 16) reads (a "+" too), ">"
_BYTE_TOKEN = re.compile(r"<0x(?:[0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")
_CHECKS = 256  # random id sequences a plan must decode as the tokenizer does
_CHECK_LEN = 16

PlanKind = Literal["bytes", "pieces", "decode"]

# "pieces" token classes
_SKIPPED = 0  # special or unknown: not in the list the decoder sees
_PLAIN = 1  # listed, not an anchor
_ANCHOR = 2  # listed, with a character the decoder's leading Strip would not remove
_BYTE = 3  # a ByteFallback byte token


def _decode_with(tokenizer: Any) -> Callable[[list[int]], str]:
    def decode(ids: list[int]) -> str:
        text: str = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    return decode


class DecodeDetokenizer:
    """The decode-based scheme: two Hugging Face decodes of a short window per step (vLLM's prefix and read
    offsets). The definition of the text, the other implementations' oracle, and their fallback."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = _decode_with(tokenizer)
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, ids: list[int]) -> str:
        """`ids`: all generated ids so far. Returns the new complete text they add."""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        text = self._decode(ids[self._prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith(_FFFD):
            return ""
        new_text = text[len(prefix_text) :]
        self._read_offset = len(ids)
        self._prefix_offset = max(0, self._read_offset - _WINDOW)
        return new_text


@dataclass(frozen=True)
class DetokenizerPlan:
    """How a tokenizer's ids become text (module docstring). Built once per tokenizer by detokenizer_plan."""

    kind: PlanKind
    reason: str  # what the plan rests on, or why it is "decode"
    # bytes: each id's bytes (b"" for a skipped id), and its text where its bytes are complete characters
    # not ending in U+FFFD (None: it goes through the incremental UTF-8 decoder)
    raw: list[bytes] = field(default_factory=list, repr=False)
    # bytes: the text above, or None; pieces: each id's text after the per-token steps (not first in the list)
    texts: list[str | None] = field(default_factory=list, repr=False)
    classes: bytes = field(default=b"", repr=False)  # pieces: each id's class (_SKIPPED ... _BYTE)

    def describe(self) -> str:
        names = {
            "bytes": "byte table (byte-level BPE)",
            "pieces": "piece table (SentencePiece)",
            "decode": "the tokenizer's decode per token",
        }
        return f"{names[self.kind]}: {self.reason}"


class IncrementalDetokenizer:
    """One sequence's detokeniser: `step(ids)` with all the ids generated so far, one more each call; -> the
    new complete text. The tokenizer's plan (detokenizer_plan) picks how."""

    __slots__ = (
        "_anchor_at_r",
        "_bytes",
        "_decode",
        "_fallback",
        "_held",
        "_last_anchor",
        "_last_byte",
        "_n",
        "_pending",
        "_plan",
        "_r",
        "_texts",
        "_utf8",
    )

    def __init__(self, tokenizer: Any, plan: DetokenizerPlan | None = None) -> None:
        self._plan = plan = plan or detokenizer_plan(tokenizer)
        self._texts = plan.texts
        self._bytes = plan.kind == "bytes"
        self._n = 0  # ids taken
        self._held = False  # bytes: text or incomplete bytes wait in _pending / _utf8
        self._utf8: Any = None  # bytes: the incremental UTF-8 decoder, made at the first held bytes
        self._pending = ""  # text of the ids since the last emission, not emitted yet
        self._r = 0  # pieces: ids emitted (DecodeDetokenizer's read offset)
        self._last_byte = -1  # pieces: index of the latest byte-fallback token
        self._last_anchor = -1  # pieces: index of the latest anchor
        self._anchor_at_r = -1  # pieces: index of the latest anchor before _r
        self._decode = _decode_with(tokenizer) if plan.kind == "pieces" else None
        self._fallback = DecodeDetokenizer(tokenizer) if plan.kind == "decode" else None

    @property
    def kind(self) -> PlanKind:
        return self._plan.kind

    @property
    def plan(self) -> DetokenizerPlan:
        return self._plan

    @property
    def holding(self) -> bool:
        """A byte table's: text or bytes of the ids taken wait for a later id (not emitted yet)."""
        return self._held

    def step(self, ids: list[int]) -> str:
        """`ids`: all generated ids so far. Returns the new complete text they add."""
        if self._bytes:
            n = len(ids)
            if self._n + 1 == n and not self._held:
                try:
                    text = self._texts[ids[-1]]
                except IndexError:  # past the tokenizer's vocabulary (a padded LM head): nothing
                    text = ""
                if text is not None:  # complete characters, none held before them
                    self._n = n
                    return text
            return self._step_bytes(ids)
        if self._fallback is not None:
            return self._fallback.step(ids)
        return self._step_pieces(ids)

    def catch_up(self, ids: list[int]) -> str:
        """The text that step() would have returned, joined, had it been called once per id of `ids` past
        those it has taken: Sequence.settle_text's, for a sequence whose text waits until it is needed. A
        byte table decodes the new ids' bytes at once where their end is a complete character (the usual
        case: step by step, the last step would emit everything held); otherwise, and for the other plans,
        it steps id by id."""
        n = len(ids)
        if self._n >= n:
            return ""
        if self._bytes:
            raw = self._plan.raw
            utf8 = self._utf8
            if utf8 is None:
                utf8 = self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            state = utf8.getstate()
            size = len(raw)
            pending: str = self._pending + utf8.decode(
                b"".join([raw[t] if t < size else b"" for t in ids[self._n :]])
            )
            if not utf8.getstate()[0] and (not pending or pending[-1] != _FFFD):
                self._n = n
                self._pending = ""
                self._held = False
                return pending
            utf8.setstate(state)  # the end is held: the last emission lies before it, found step by step
        out = []
        prefix = ids[: self._n]
        for t in ids[self._n :]:
            prefix.append(t)
            out.append(self.step(prefix))
        return "".join(out)

    def _step_bytes(self, ids: list[int]) -> str:
        raw = self._plan.raw
        utf8 = self._utf8
        if utf8 is None:
            utf8 = self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        for t in ids[self._n :]:
            b = raw[t] if t < len(raw) else b""
            if b:
                self._pending += utf8.decode(b)
        self._n = len(ids)
        pending = self._pending
        if pending and pending[-1] != _FFFD and not utf8.getstate()[0]:
            self._pending = ""
            self._held = False
            return pending
        self._held = bool(pending) or bool(utf8.getstate()[0])
        return ""

    def _step_pieces(self, ids: list[int]) -> str:
        texts, classes = self._texts, self._plan.classes
        n = len(ids)
        for i in range(self._n, n):
            t = ids[i]
            if t >= len(classes):
                continue  # unknown: skipped
            c = classes[t]
            if c == _BYTE:
                self._last_byte = i
            elif c == _ANCHOR:
                self._last_anchor = i
            self._pending += texts[t] or ""
        self._n = n
        r = self._r
        p = r - _WINDOW if r > _WINDOW else 0
        if self._last_byte < p and self._anchor_at_r >= p:
            new_text = self._pending
            if not new_text or new_text[-1] == _FFFD:
                return ""
        else:  # the window's start or a byte-fallback run: DecodeDetokenizer's step
            assert self._decode is not None
            prefix_text = self._decode(ids[p:r])
            text = self._decode(ids[p:])
            if len(text) <= len(prefix_text) or text.endswith(_FFFD):
                return ""
            new_text = text[len(prefix_text) :]
        self._r = n
        self._pending = ""
        self._anchor_at_r = self._last_anchor
        return new_text


def ending_bytes_table(plan: DetokenizerPlan, last_bytes: frozenset[int]) -> bytes:
    """A byte plan's ids as a table of flags: 1 where the id's bytes hold one of `last_bytes` (the final
    UTF-8 byte of a stop string's last character), 0 elsewhere. A stop string's match ends in a character
    whose final byte some id brought: ids without one cannot complete a match (Sequence.stop_bytes). Built
    once per plan and byte, kept with the plan."""
    if id(plan) not in _BYTE_TABLES and len(_BYTE_TABLES) >= 8:  # (tests make many tokenizers)
        _BYTE_TABLES.clear()
    tables = _BYTE_TABLES.setdefault(id(plan), (plan, {}))[1]
    flags = 0
    for b in last_bytes:
        table = tables.get(b)
        if table is None:
            table = tables[b] = bytes(b in raw for raw in plan.raw)
        flags |= int.from_bytes(table, "little")
    return flags.to_bytes(len(plan.raw), "little")


_BYTE_TABLES: dict[int, tuple[DetokenizerPlan, dict[int, bytes]]] = {}  # id(plan) -> (plan, byte -> table)


# ---- plans ----------------------------------------------------------------------------------------------

_PLANS: weakref.WeakKeyDictionary[Any, tuple[int, DetokenizerPlan]] = weakref.WeakKeyDictionary()


def detokenizer_plan(tokenizer: Any) -> DetokenizerPlan:
    """The tokenizer's plan, built at the first call for it (a table of its vocabulary, checked against its
    decoding: a fraction of a second for 50k tokens) and kept while the tokenizer lives."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = -1
    try:
        hit = _PLANS.get(tokenizer)
    except TypeError:  # not weakly referenceable or not hashable: built each time
        return build_plan(tokenizer)
    if hit is not None and hit[0] == size:
        return hit[1]
    plan = build_plan(tokenizer)
    _PLANS[tokenizer] = (size, plan)
    return plan


def _fast_tokenizer(tokenizer: Any) -> tuple[Any, str | None]:
    """(its tokenizers.Tokenizer, None) where `tokenizer.decode(ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)` is exactly that Tokenizer's decode(ids, skip_special_tokens=True);
    else (None, why not)."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast  # transformers 5: TokenizersBackend
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None, "transformers or tokenizers is not installed"
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None, f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer"
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None, f"{cls.__name__} decodes in a way of its own"
    if {"decode", "_decode"} & set(vars(tokenizer)):
        return None, "the tokenizer's decode is replaced on the object"
    bt = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(bt, Tokenizer):
        return None, "no tokenizers.Tokenizer behind it"
    return bt, None


def _decoder_steps(bt: Any) -> list[dict[str, Any]] | None:
    if bt.decoder is None:
        return None
    spec = json.loads(bt.decoder.__getstate__())
    steps: list[dict[str, Any]] = []

    def flatten(d: dict[str, Any]) -> None:
        if d.get("type") == "Sequence":
            for inner in d.get("decoders", []):
                flatten(inner)
        else:
            steps.append(d)

    flatten(spec)
    return steps


def build_plan(tokenizer: Any) -> DetokenizerPlan:
    """The plan for `tokenizer` (module docstring), checked: every id alone, and _CHECKS random id sequences
    (special, byte and multi-byte tokens among them), must decode to the plan's text as the tokenizer decodes
    them, else the plan is "decode"."""
    enabled = gc.isenabled()
    gc.disable()  # a table of the vocabulary's objects would run full collections over the process's heap
    try:
        return _build_plan(tokenizer)
    finally:
        if enabled:
            gc.enable()


def _build_plan(tokenizer: Any) -> DetokenizerPlan:
    bt, why = _fast_tokenizer(tokenizer)
    if bt is None:
        return DetokenizerPlan("decode", why or "")
    steps = _decoder_steps(bt)
    if steps is None:
        return DetokenizerPlan("decode", "the tokenizer has no decoder (tokens joined by spaces)")
    size = bt.get_vocab_size(with_added_tokens=True)
    added = bt.get_added_tokens_decoder()
    size = max([size, *(i + 1 for i in added)])
    tokens: list[str | None] = [bt.id_to_token(i) for i in range(size)]
    special = {t.content for t in added.values() if t.special}
    listed = [s if s is not None and s not in special else None for s in tokens]  # None: skipped
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        plan = _bytes_plan(listed)
        simulate: Callable[[list[int]], str] = lambda ids: b"".join(  # noqa: E731
            plan.raw[t] if t < len(plan.raw) else b"" for t in ids
        ).decode("utf-8", "replace")
        alone: Callable[[int], str] = lambda t: plan.raw[t].decode("utf-8", "replace")  # noqa: E731
    else:
        pieces = _PieceDecoder.parse(steps)
        if isinstance(pieces, str):
            return DetokenizerPlan("decode", pieces)
        plan = pieces.plan(listed)
        simulate = lambda ids: pieces.decode([listed[t] for t in ids if t < len(listed)])  # noqa: E731
        alone = lambda t: pieces.decode([listed[t]])  # noqa: E731
    specials = [i for i, t in enumerate(tokens) if t is not None and t in special]
    problem = _check(tokenizer, bt, simulate, alone, size, specials)
    if problem is not None:
        return DetokenizerPlan("decode", f"the {plan.kind} table failed its check: {problem}")
    return plan


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel pre-tokenisation emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_table() -> dict[int, str]:
    """str.translate's table from GPT-2's printable stand-in characters to the bytes they stand for (as
    chr(byte)); every other character below 256 to one past them, so that a token with a character outside
    the alphabet fails latin-1 encoding."""
    out: dict[int, str] = dict.fromkeys(range(256), "\U0010ffff")
    out.update({ord(c): chr(b) for b, c in bytes_to_unicode().items()})
    return out


def _bytes_plan(listed: list[str | None]) -> DetokenizerPlan:
    """ByteLevel's decode_chain per token: each character's byte where every character has one, else the
    token's own UTF-8 (an added token's content outside the byte alphabet)."""
    table = _byte_level_table()
    raw: list[bytes] = []
    texts: list[str | None] = []
    for s in listed:
        if s is None:
            raw.append(b"")
            texts.append("")
            continue
        try:
            b = s.translate(table).encode("latin-1")
        except UnicodeEncodeError:
            b = s.encode()
        raw.append(b)
        try:
            text: str | None = b.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        texts.append(None if text is None or text.endswith(_FFFD) else text)
    return DetokenizerPlan("bytes", "its decoder is ByteLevel alone", raw=raw, texts=texts)


@dataclass
class _PieceDecoder:
    """A SentencePiece decoder the "pieces" plan stands for: per-token steps (Replace of a string,
    Metaspace, ByteFallback) in order, then optionally Fuse, then optionally a leading Strip."""

    per_token: list[dict[str, Any]]
    strip: tuple[str, int] | None  # (content, start)
    describe: str

    @classmethod
    def parse(cls, steps: list[dict[str, Any]]) -> _PieceDecoder | str:
        """The decoder, or why the plan cannot stand for it."""
        per_token: list[dict[str, Any]] = []
        fused = False
        strip = None
        for s in steps:
            kind = s.get("type")
            if strip is not None:
                return f"its decoder has a {kind} after Strip"
            if kind in ("Replace", "Metaspace", "ByteFallback"):
                if fused:
                    return f"its decoder has a {kind} after Fuse (on the whole text)"
                if kind == "Replace" and (
                    set(s.get("pattern", {})) != {"String"} or not s["pattern"]["String"]
                ):
                    return "its decoder replaces a regular expression"
                if kind == "Metaspace" and s.get("prepend_scheme") not in ("first", "always", "never"):
                    return f"its Metaspace decoder has prepend_scheme {s.get('prepend_scheme')!r}"
                if kind == "Metaspace" and len(s.get("replacement", "")) != 1:
                    return "its Metaspace replacement is not one character"
                per_token.append(s)
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip":
                if not fused:
                    return "its decoder strips each token (Strip before Fuse)"
                if s.get("stop", 0) != 0 or len(s.get("content", "")) != 1:
                    return "its decoder strips the text's end"
                strip = (s["content"], int(s.get("start", 0)))
            else:
                return f"its decoder has a {kind} step (not Replace, Metaspace, ByteFallback, Fuse, Strip)"
        if not any(s["type"] in ("Replace", "Metaspace") for s in per_token):
            return "its decoder is none of ByteLevel, Replace or Metaspace"
        names = [s["type"] for s in steps]
        return cls(per_token, strip, "its decoder is " + ", ".join(names))

    def _token(self, s: str, first: bool) -> str | None:
        """A listed token through the per-token steps; None where ByteFallback takes it as a byte."""
        for step in self.per_token:
            kind = step["type"]
            if kind == "Replace":
                s = s.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":
                rep = "" if first and step["prepend_scheme"] != "never" else " "
                s = s.replace(step["replacement"], rep)
            elif len(s.encode()) == 6 and _BYTE_TOKEN.fullmatch(s):
                return None
        return s

    def plan(self, listed: list[str | None]) -> DetokenizerPlan:
        content = self.strip[0] if self.strip is not None else None
        texts: list[str | None] = []
        classes = bytearray()
        for s in listed:
            text = None if s is None else self._token(s, first=False)
            texts.append(text or "")
            if s is None:
                classes.append(_SKIPPED)
            elif text is None:
                classes.append(_BYTE)
            elif any(c != content for c in text):  # (Metaspace's first-token rule: any listed token)
                classes.append(_ANCHOR)
            else:
                classes.append(_PLAIN)
        return DetokenizerPlan("pieces", self.describe, texts=texts, classes=bytes(classes))

    def decode(self, tokens: list[str | None]) -> str:
        """The decoder's text of a list of ids' tokens (None: skipped), as Hugging Face's decode computes
        it (the plan's check; the steps it stands for)."""
        listed = [s for s in tokens if s is not None]
        out: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                try:
                    out.append(bytes(run).decode("utf-8"))
                except UnicodeDecodeError:
                    out.extend(_FFFD * len(run))
                run.clear()

        for i, s in enumerate(listed):
            text = self._token(s, first=i == 0)
            if text is None:
                run.append(int(s[3:5], 16))
            else:
                flush()
                out.append(text)
        flush()
        text = "".join(out)
        if self.strip is not None:
            content, start = self.strip
            cut = 0
            while cut < min(start, len(text)) and text[cut] == content:
                cut += 1
            text = text[cut:]
        return text


def _check(
    tokenizer: Any,
    bt: Any,
    simulate: Callable[[list[int]], str],
    alone: Callable[[int], str],
    size: int,
    specials: list[int],
) -> str | None:
    """Whether the plan's text of every id alone and of _CHECKS random sequences is the tokenizer's; -> the
    first difference, or None."""
    wants = bt.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    partial = []  # ids whose text is not complete on its own (part of a character, byte-fallback tokens)
    for i, want in enumerate(wants):
        text = alone(i)
        if text != want:
            return f"token {i} decodes to {want!r}, the table's to {text!r}"
        if text.endswith(_FFFD):
            partial.append(i)
    rng = random.Random(0)
    pools = [list(range(size)), specials or [0], partial or [0], [size, size + 1]]  # (past the vocabulary)
    decode = _decode_with(tokenizer)
    for _ in range(_CHECKS):
        ids = [
            rng.choice(pools[rng.choice((0, 0, 0, 1, 2, 2, 3))]) for _ in range(rng.randint(1, _CHECK_LEN))
        ]
        want = decode(ids)
        if simulate(ids) != want:
            return f"ids {ids} decode to {want!r}, the table's to {simulate(ids)!r}"
    return None
