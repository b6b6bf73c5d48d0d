"""Reasoning models: which generated tokens are thinking and which are the answer. Pure Python.

Two families of markers, both read off the tokenizer at load (`ReasoningMarkers.detect`):
- "think" (Qwen3, DeepSeek-R1 distills, Phi-4-reasoning, QwQ): `<think>` ... `</think>`, each one token.
  A chat template may open the block in the prompt (DeepSeek-R1: the generation prompt ends in `<think>`),
  close it there (Qwen3 with enable_thinking=false: `<think>\\n\\n</think>\\n\\n`), or leave the model to
  open it; the prompt's last tokens say which (`initial_phase`).
- "harmony" (gpt-oss): `<|channel|>analysis<|message|>` ... `<|end|>`, then
  `<|start|>assistant<|channel|>final<|message|>` and the answer. Headers are structural: a header naming
  the analysis channel opens thinking, any other (final, commentary) the answer.

Per sequence, a ReasoningState sorts each generated token into a role (`feed`): "marker" (structure,
never rendered), "reasoning" or "answer"; only answer tokens meet the request's stop strings, grammar,
labels and logprobs. Every token before the answer counts as a reasoning token (usage). A thinking budget
(max_reasoning_tokens) replaces the next sampled tokens with the closing sequence (`forced`), fed to the
model as generated tokens, so the answer follows what the model would see had it closed the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ParserKind = Literal["think", "harmony"]
Phase = Literal["pre", "thinking", "closing", "answer"]
Role = Literal["marker", "reasoning", "answer"]
# A marker among the prompt's last TAIL tokens is the generation prompt's (`<think>\n`, `</think>\n\n`); an
# older turn's lies further back, behind at least that turn's end and the assistant's header.
TAIL = 6


@dataclass(frozen=True)
class ReasoningMarkers:
    """A model's reasoning markers as token ids."""

    kind: ParserKind
    start: int  # think: <think>; harmony: <|channel|> (a header's start)
    end: int  # think: </think>; harmony: <|end|>
    close: tuple[int, ...]  # what a budget forces inside thinking (harmony: through the final header)
    open_close: tuple[int, ...]  # what a budget forces before thinking opened (an empty block / final header)
    message: int = -1  # harmony: <|message|>, the end of a header
    turn: int = -1  # harmony: <|start|>, a message's start
    analysis: tuple[int, ...] = ()  # harmony: the ids of "analysis" (a header naming it opens thinking)

    @classmethod
    def detect(cls, tokenizer: Any, model_type: str | None, setting: str) -> ReasoningMarkers | None:
        """`setting`: EngineConfig.reasoning_parser ("auto", "none", "think", "harmony"). auto: harmony for
        a vocabulary with gpt-oss's channel tokens, think for one with <think> and </think> as single tokens,
        else none (`model_type` only names the model in errors). A named parser the vocabulary cannot serve raises ValueError."""
        if setting == "none":
            return None
        vocab = tokenizer.get_vocab()
        harmony = all(t in vocab for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
        think = "<think>" in vocab and "</think>" in vocab
        kind = setting
        if setting == "auto":
            # (a gpt-oss checkpoint whose tokenizer lacks the channel tokens has nothing to split at)
            kind = "harmony" if harmony else "think" if think else "none"
            if kind == "none":
                return None
        if kind == "harmony":
            if not harmony:
                raise ValueError(
                    f"reasoning_parser 'harmony': the tokenizer of this {model_type or 'model'} has no <|channel|>, "
                    "<|message|>, <|end|> and <|start|> tokens"
                )
            ids = _encoder(tokenizer)
            return cls(
                kind="harmony",
                start=vocab["<|channel|>"],
                end=vocab["<|end|>"],
                close=tuple(ids("<|end|><|start|>assistant<|channel|>final<|message|>")),
                open_close=tuple(ids("<|channel|>final<|message|>")),
                message=vocab["<|message|>"],
                turn=vocab["<|start|>"],
                analysis=tuple(ids("analysis")),
            )
        if kind == "think":
            if not think:
                raise ValueError("reasoning_parser 'think': the tokenizer has no <think> and </think> tokens")
            start, end = vocab["<think>"], vocab["</think>"]
            return cls(kind="think", start=start, end=end, close=(end,), open_close=(start, end))
        raise ValueError(f"reasoning_parser {setting!r}: expected auto, none, think or harmony")

    def initial_phase(self, prompt_ids: list[int]) -> Phase:
        """Where the first generated token stands, from the template's last markers in the prompt."""
        tail = prompt_ids[-TAIL:]
        if self.kind == "think":
            last = max((i for i, t in enumerate(tail) if t in (self.start, self.end)), default=None)
            if last is None:
                return "pre"
            return "thinking" if tail[last] == self.start else "answer"
        turn = max((i for i, t in enumerate(prompt_ids) if t == self.turn), default=None)
        turn_ids = prompt_ids[turn:] if turn is not None else []
        if self.message not in turn_ids:
            return "pre"  # the model writes the header (the prompt ends in <|start|>assistant)
        return "thinking" if _contains(turn_ids[: turn_ids.index(self.message)], self.analysis) else "answer"

    def state(self, prompt_ids: list[int], budget: int | None) -> ReasoningState:
        state = ReasoningState(self, self.initial_phase(prompt_ids), budget)
        if budget == 0 and state.phase in ("pre", "thinking"):
            state.forced = list(self.close if state.phase == "thinking" else self.open_close)
            state.phase = "closing"
        return state


@dataclass
class ReasoningState:
    """One sequence's place in its reasoning: fed every generated token in order."""

    markers: ReasoningMarkers
    phase: Phase
    budget: int | None  # max_reasoning_tokens: tokens generated (an opening <think> too) before the close is
    # forced, so the close starts at that output index (None: no budget)
    tokens: int = 0  # generated before the answer (markers included): usage's reasoning_tokens
    forced: list[int] = field(default_factory=list)  # the next tokens, in place of what is sampled
    header: list[int] = field(default_factory=list)  # harmony: the header being written

    @property
    def in_answer(self) -> bool:
        return self.phase == "answer"

    def close_bound(self) -> tuple[int, int] | None:
        """Where a budget bounds the thinking: (thinking tokens, close tokens), at most what the sequence
        generates before its answer: the budget (or what it already took), then the close that the budget
        (or the model's own end marker, harmony) forces. None: no budget, or the answer already started."""
        if self.budget is None or self.phase == "answer":
            return None
        if self.phase == "closing":  # the close is being forced (a budget of 0 forces it at once)
            return self.tokens, len(self.forced)
        m = self.markers
        close = len(m.close)
        if self.phase == "pre" and m.kind == "harmony":  # a budget may end a header it is still writing
            close = max(close, len(m.open_close))
        return max(self.budget, self.tokens), close

    def copy(self) -> ReasoningState:
        """The same place, with lists of its own (an n > 1 request's samples think apart)."""
        return ReasoningState(
            self.markers, self.phase, self.budget, self.tokens, list(self.forced), list(self.header)
        )

    @property
    def opening_token(self) -> int | None:
        """Before thinking opened (think markers): the token that opens it, which a grammar-constrained
        request may sample beside what its grammar allows (the answer's first token, or thinking)."""
        return self.markers.start if self.phase == "pre" and self.markers.kind == "think" else None

    def next_token(self, sampled: int) -> int:
        """The token the sequence takes: a forced one where the budget closes the thinking, else `sampled`."""
        return self.forced.pop(0) if self.forced else sampled

    def opens_answer(self, token: int) -> bool:
        """Whether `token`, sampled before thinking opened, is the answer's first token (think markers: any
        token but <think>)."""
        return self.phase == "pre" and self.markers.kind == "think" and token != self.markers.start

    def answer_now(self) -> None:
        """The answer starts here (a `choices` request whose model answers without thinking: the token it
        sampled is dropped and the labels are scored at its position)."""
        self.phase = "answer"

    def feed(self, token: int) -> Role:
        """The role of the next generated token (after next_token); advances the phase."""
        m = self.markers
        if self.phase == "answer":
            return "answer"
        if self.phase == "pre" and m.kind == "think" and token != m.start:
            self.phase = "answer"
            return "answer"
        self.tokens += 1
        role: Role = "marker"
        if self.phase == "closing":
            if not self.forced:
                self.phase = "answer"
        elif self.phase == "pre":
            if m.kind == "think":
                self.phase = "thinking"
            elif token == m.message:
                opened = _contains(self.header, m.analysis)
                self.header = []
                self.phase = "thinking" if opened else "answer"
            else:
                self.header.append(token)
        elif token == m.end:  # thinking ends where the model closes it
            self.forced = list(m.close[1:])  # harmony: the final channel's header follows
            self.phase = "closing" if self.forced else "answer"
        else:
            role = "reasoning"
        if self.budget is not None and self.tokens >= self.budget and self.phase in ("pre", "thinking"):
            self.forced = list(m.close if self.phase == "thinking" else m.open_close)
            self.phase = "closing"
        return role


def _contains(seq: list[int], part: tuple[int, ...]) -> bool:
    n = len(part)
    return n > 0 and any(tuple(seq[i : i + n]) == part for i in range(len(seq) - n + 1))


def _encoder(tokenizer: Any) -> Any:
    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    return ids
