"""The reasoning state machine alone (pure Python): think markers and gpt-oss's harmony channels, the
prompt's last markers, the budget's forced close."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tiny_models import END_THINK, THINK, byte_tokenizer, think_tokenizer
from worker.engine.reasoning import ReasoningMarkers, ReasoningState

HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]


def harmony_tokenizer() -> Any:
    tok = byte_tokenizer(chat_template=False)
    tok.add_special_tokens({"additional_special_tokens": ["<unk>", "<s>", "</s>", *HARMONY_SPECIALS]})
    return tok


def ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def roles(state: ReasoningState, tokens: list[int]) -> list[str]:
    return [state.feed(state.next_token(t)) for t in tokens]


def test_detection_from_the_vocabulary_and_the_setting() -> None:
    think = ReasoningMarkers.detect(think_tokenizer(), "qwen3", "auto")
    assert think is not None and (think.kind, think.start, think.end) == ("think", THINK, END_THINK)
    assert ReasoningMarkers.detect(byte_tokenizer(), "qwen3", "auto") is None
    assert ReasoningMarkers.detect(think_tokenizer(), "qwen3", "none") is None
    harmony = ReasoningMarkers.detect(harmony_tokenizer(), "gpt_oss", "auto")
    assert harmony is not None and harmony.kind == "harmony"
    with pytest.raises(ValueError, match="no <think> and </think>"):
        ReasoningMarkers.detect(byte_tokenizer(), "llama", "think")


def test_think_phases_from_the_prompt() -> None:
    tok = think_tokenizer()
    m = ReasoningMarkers.detect(tok, None, "think")
    assert m is not None
    assert m.initial_phase(ids(tok, "q</s>\n<s>assistant\n")) == "pre"
    assert m.initial_phase(ids(tok, "q</s>\n<s>assistant\n<think>\n")) == "thinking"
    assert m.initial_phase(ids(tok, "q</s>\n<s>assistant\n<think>\n\n</think>\n\n")) == "answer"
    # an older turn's thinking is no concern of this one
    assert m.initial_phase(ids(tok, "<think>a</think>b</s>\n<s>user\nq</s>\n<s>assistant\n")) == "pre"


def test_think_roles_and_budget() -> None:
    tok = think_tokenizer()
    m = ReasoningMarkers.detect(tok, None, "think")
    assert m is not None
    s = m.state([], None)
    assert roles(s, [THINK, 70, 71, END_THINK, 72]) == [
        "marker",
        "reasoning",
        "reasoning",
        "marker",
        "answer",
    ]
    assert s.tokens == 4 and s.in_answer
    s = m.state(ids(tok, "<think>\n"), 2)  # opened by the prompt: two tokens, then </think> is forced
    assert roles(s, [70, 71, 99, 72]) == ["reasoning", "reasoning", "marker", "answer"]
    assert s.tokens == 3
    s = m.state([], 0)  # no thinking at all: an empty block is forced
    assert [s.next_token(5), s.next_token(5)] == [THINK, END_THINK] and s.forced == []
    s = m.state([], None)
    assert s.opens_answer(70) and not s.opens_answer(THINK)
    assert roles(s, [70]) == ["answer"] and s.tokens == 0


def test_harmony_channels() -> None:
    tok = harmony_tokenizer()
    m = ReasoningMarkers.detect(tok, "gpt_oss", "auto")
    assert m is not None
    prompt = ids(tok, "<|start|>user<|message|>q<|end|><|start|>assistant")
    assert m.initial_phase(prompt) == "pre"
    assert m.initial_phase(prompt + ids(tok, "<|channel|>analysis<|message|>")) == "thinking"
    assert m.initial_phase(prompt + ids(tok, "<|channel|>final<|message|>")) == "answer"
    head, think, close = (
        "<|channel|>analysis<|message|>",
        "hm",
        "<|end|><|start|>assistant<|channel|>final<|message|>",
    )
    s = m.state(prompt, None)
    out = [*ids(tok, head + think), m.end]
    got = roles(s, out)
    assert got == ["marker"] * len(ids(tok, head)) + ["reasoning"] * 2 + ["marker"]
    # after <|end|> the final channel's header is forced, then the answer
    rest = ids(tok, close)[1:]
    assert s.forced == rest
    assert roles(s, [0] * len(rest)) == ["marker"] * len(rest)
    assert roles(s, ids(tok, "ok")) == ["answer", "answer"]
    assert s.tokens == len(out) + len(rest)
    # a header naming another channel opens the answer
    s = m.state(prompt, None)
    assert roles(s, ids(tok, "<|channel|>final<|message|>x"))[-1] == "answer"
    # the budget closes the analysis channel through the final header
    s = m.state(prompt + ids(tok, head), 1)
    assert roles(s, ids(tok, "a"))[-1] == "reasoning" and s.forced == ids(tok, close)
