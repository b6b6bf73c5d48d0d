"""Reasoning models against HF transformers in float32: the split at the think markers, the thinking budget,
choices / grammar after thinking, stop rules inside thinking, template variables reaching the template.

The tiny random Qwen3 model (tests/tiny_models.build_think_checkpoint) has a tokenizer with <think> and
</think> and greedy decoding that opens and closes its thinking on its own. Every expectation comes from
HF's greedy path over the same checkpoint, decoded and split at the markers.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import (
    END_THINK,
    EOS_ID,
    OPEN,
    THINK,
    THINK_ASK,
    build_think_checkpoint,
    hf_greedy,
    think_prompt_ids,
    think_tokenizer,
)
from worker.engine import engine as engine_module
from worker.engine.engine import Engine
from worker.engine.params import Constraint, GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine_config import EngineConfig

LABELS = ("positive", "negative", "neutral")


@torch.no_grad()
def hf_label_logprob(hf, context: list[int], label: list[int]) -> float:  # type: ignore[no-untyped-def]
    lp = torch.log_softmax(hf(torch.tensor([context + label])).logits[0].float(), dim=-1)
    return sum(float(lp[len(context) - 1 + i, t]) for i, t in enumerate([*label, EOS_ID]))


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, object, object]:
    path = build_think_checkpoint(tmp_path_factory.mktemp("think"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.02, block_size=8))
    return engine, hf, think_tokenizer()


def chat(rid: str, kwargs: dict[str, object] | None = None, **params: object) -> EngineRequest:
    p = GenerationParams(**{"max_new_tokens": 40, "temperature": 0.0, **params})  # type: ignore[arg-type]
    return EngineRequest(rid, p, messages=THINK_ASK, chat_template_kwargs=kwargs)


def decode(tok, ids: list[int]) -> str:  # type: ignore[no-untyped-def]
    """HF's text of `ids`, less a character the last bytes leave incomplete (the engine never shows one)."""
    return str(tok.decode([t for t in ids if t != EOS_ID], skip_special_tokens=True)).rstrip("\ufffd")


def check_split(tok, res: EngineResult, ref: list[int], opened: bool) -> None:  # type: ignore[no-untyped-def]
    """The result is HF's greedy tokens, their text split at the markers."""
    assert res.token_ids == ref
    end = ref.index(END_THINK)
    assert opened or ref[0] == THINK
    assert res.reasoning_content == decode(tok, ref[0 if opened else 1 : end])
    assert res.text == decode(tok, ref[end + 1 :])
    assert res.reasoning_tokens == end + 1
    assert res.completion_tokens == len(ref)


def test_marker_detection(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, _, _ = reasoner
    assert engine.reasoning is not None and engine.reasoning.kind == "think"
    assert (engine.reasoning.start, engine.reasoning.end) == (THINK, END_THINK)


def test_split_matches_hf_whether_the_prompt_or_the_model_opens_thinking(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    opened, plain = engine.generate([chat("opened", OPEN), chat("plain")])
    check_split(tok, opened, hf_greedy(hf, think_prompt_ids(tok, **OPEN), 40), opened=True)
    check_split(tok, plain, hf_greedy(hf, think_prompt_ids(tok), 40), opened=False)
    assert opened.reasoning_content and plain.reasoning_content  # both thought before answering


def test_template_variables_reach_the_template(reasoner) -> None:  # type: ignore[no-untyped-def]
    """enable_thinking=false closes the thinking in the prompt: the whole output is the answer."""
    engine, hf, tok = reasoner
    (res,) = engine.generate([chat("off", {"enable_thinking": False})])
    ids = think_prompt_ids(tok, enable_thinking=False)
    assert res.prompt_tokens == len(ids) == len(think_prompt_ids(tok)) + 6  # <think>\n\n</think>\n\n
    ref = hf_greedy(hf, ids, 40)
    assert res.token_ids == ref and res.text == decode(tok, ref)
    assert res.reasoning_content == "" and res.reasoning_tokens == 0
    (effort,) = engine.generate([chat("effort", {"reasoning_effort": "low", "enable_thinking": False})])
    assert effort.prompt_tokens == len(think_prompt_ids(tok, reasoning_effort="low", enable_thinking=False))
    assert effort.prompt_tokens > res.prompt_tokens


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_budget_forces_the_end_of_thinking_at_exactly_max_reasoning_tokens(reasoner, budget: int) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    ids = think_prompt_ids(tok, **OPEN)
    assert hf_greedy(hf, ids, 40).index(END_THINK) > budget  # the model would think on
    (res,) = engine.generate([chat("budget", OPEN, max_reasoning_tokens=budget)])
    ref = hf_greedy(hf, ids, 40, forced={budget: END_THINK})
    assert res.token_ids == ref and ref[budget] == END_THINK
    assert res.reasoning_content == decode(tok, ref[:budget])
    assert res.text == decode(tok, ref[budget + 1 :])
    assert res.reasoning_tokens == budget + 1


def test_budget_where_the_model_opens_thinking(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    (res,) = engine.generate([chat("budget", max_reasoning_tokens=4)])
    ref = hf_greedy(hf, think_prompt_ids(tok), 40, forced={4: END_THINK})
    assert ref[0] == THINK and res.token_ids == ref
    assert res.reasoning_content == decode(tok, ref[1:4]) and res.reasoning_tokens == 5


@pytest.mark.parametrize("budget", [None, 2])
def test_choices_after_thinking_score_at_the_answer_position(reasoner, budget: int | None) -> None:  # type: ignore[no-untyped-def]
    """Thinking first, unconstrained; then every label scored after the end marker, as HF scores it there."""
    engine, hf, tok = reasoner
    ids = think_prompt_ids(tok, **OPEN)
    thought = hf_greedy(hf, ids, 40, forced=None if budget is None else {budget: END_THINK})
    thought = thought[: thought.index(END_THINK) + 1]
    (res,) = engine.generate([chat("label", OPEN, choices=LABELS, max_reasoning_tokens=budget)])
    assert res.label_scores is not None and res.finish_reason == "eos"
    want = [hf_label_logprob(hf, ids + thought, engine.prompts.label_ids((label,))[0]) for label in LABELS]
    for score, lp in zip(res.label_scores, want, strict=True):
        assert abs(score.logprob - lp) < 1e-4, (score, lp)
    best = max(range(len(LABELS)), key=lambda i: want[i])
    assert res.text == LABELS[best]
    assert res.reasoning_content == decode(tok, thought[:-1])
    assert res.token_ids[: len(thought)] == thought and res.token_ids[-1] == EOS_ID
    assert res.reasoning_tokens == len(thought)


def test_choices_with_thinking_off_score_after_the_prompt(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    (res,) = engine.generate([chat("off", {"enable_thinking": False}, choices=LABELS)])
    ids = think_prompt_ids(tok, enable_thinking=False)
    assert res.label_scores is not None and res.reasoning_content == ""
    for score, label in zip(res.label_scores, LABELS, strict=True):
        assert abs(score.logprob - hf_label_logprob(hf, ids, engine.prompts.label_ids((label,))[0])) < 1e-4


def test_grammar_applies_to_the_answer_only(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    ids = think_prompt_ids(tok, **OPEN)
    (res,) = engine.generate(
        [chat("re", OPEN, constraint=Constraint("regex", "(yes|no)"), max_reasoning_tokens=5)]
    )
    ref = hf_greedy(hf, ids, 40, forced={5: END_THINK})
    assert res.token_ids[:6] == ref[:6]  # the thinking is the model's own, unmasked
    assert res.reasoning_content == decode(tok, ref[:5])
    assert res.text in ("yes", "no") and res.finish_reason == "stop"


def test_stop_strings_skip_the_thinking_and_cut_the_answer(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    ref = hf_greedy(hf, think_prompt_ids(tok, **OPEN), 40)
    end = ref.index(END_THINK)
    thinking, answer = decode(tok, ref[:end]), decode(tok, ref[end + 1 :])
    in_thinking = thinking[2:4]
    assert len(answer) > 4 and in_thinking not in answer[:3]
    (res,) = engine.generate([chat("stop", OPEN, stop=(in_thinking, answer[2:4]))])
    assert res.reasoning_content == thinking
    assert res.text == answer[: answer.index(answer[2:4])] and res.finish_reason == "stop"


def test_a_stop_token_inside_thinking_ends_with_the_thinking_so_far(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    ref = hf_greedy(hf, think_prompt_ids(tok, **OPEN), 40)
    stop_at = next(i for i in range(2, ref.index(END_THINK)) if ref[i] not in ref[:i])
    (res,) = engine.generate([chat("stop", OPEN, stop_token_ids=(ref[stop_at],))])
    assert res.finish_reason == "stop" and res.text == ""
    assert res.reasoning_content == decode(tok, ref[:stop_at])
    assert res.token_ids == ref[: stop_at + 1]


def test_a_timeout_inside_thinking_ends_with_the_thinking_so_far(reasoner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = reasoner
    ref = hf_greedy(hf, think_prompt_ids(tok, **OPEN), 40)
    assert ref.index(END_THINK) > 3
    p = GenerationParams(max_new_tokens=40, temperature=0.0, timeout_s=60.0)
    engine.add_request(EngineRequest("slow", p, messages=THINK_ASK, chat_template_kwargs=OPEN))
    done: list[EngineResult] = []
    while not done:
        done = engine.step()
        seq = engine._seqs.get("slow")
        if seq is not None and len(seq.output_ids) == 3:
            # its clock runs out while it thinks (as if its steps had been slow): the engine's clock jumps
            later = time.monotonic() + 120.0
            monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda at=later: at))
    (res,) = done
    assert res.finish_reason == "timeout" and res.text == ""
    assert res.token_ids == ref[:3] and res.reasoning_content == decode(tok, ref[:3])


def test_raw_prompts_are_not_split(reasoner) -> None:  # type: ignore[no-untyped-def]
    """As vLLM: reasoning parsers serve chat requests; a raw prompt's output is its text."""
    engine, _, tok = reasoner
    ids = think_prompt_ids(tok, **OPEN)
    p = GenerationParams(max_new_tokens=20, temperature=0.0)
    (res,) = engine.generate([EngineRequest("raw", p, prompt_token_ids=ids)])
    assert res.reasoning_content is None and res.reasoning_tokens == 0


def test_no_parser_keeps_the_thinking_in_the_text(reasoner, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine, _, _ = reasoner
    cfg = EngineConfig(
        model=engine.checkpoint_dir, dtype="float32", kv_cache_gb=0.02, block_size=8, reasoning_parser="none"
    )
    plain = Engine.load(cfg)
    (res,) = plain.generate([chat("none", OPEN)])
    assert plain.reasoning is None and res.reasoning_content is None
    with pytest.raises(ValueError, match=re.escape("no <|channel|>")):
        Engine.load(cfg.model_copy(update={"reasoning_parser": "harmony"}))


def test_reasoning_requests_are_batch_invariant_through_preemption(reasoner) -> None:  # type: ignore[no-untyped-def]
    """A pool too small for the batch preempts sequences mid-thought, mid-close and before their labels; each
    resumes by recomputation and ends as it does alone."""
    engine, _, _ = reasoner
    small = Engine.load(
        EngineConfig(
            model=engine.checkpoint_dir, dtype="float32", kv_cache_gb=0.0006, block_size=8, max_num_seqs=8
        )
    )
    regex = Constraint("regex", "(yes|no)")
    reqs = [
        chat("a", OPEN, max_new_tokens=80),
        chat("b", OPEN, max_reasoning_tokens=2),
        chat("c", OPEN, choices=LABELS),
        chat("d", OPEN, choices=LABELS, max_reasoning_tokens=1),
        chat("e", OPEN, constraint=regex, max_reasoning_tokens=6),
        chat("f", max_new_tokens=80),
        chat("g", max_reasoning_tokens=3, choices=LABELS),
        chat("h", {"enable_thinking": False}, choices=LABELS),
    ]
    small.scheduler.new_token_ratio = 0.1  # expect little growth: admit many, preempt when they grow
    together = small.generate(reqs)
    assert small.scheduler.preemptions > 0
    for req, res in zip(reqs, together, strict=True):
        (alone,) = engine.generate([req])
        assert (res.token_ids, res.text, res.reasoning_content) == (
            alone.token_ids,
            alone.text,
            alone.reasoning_content,
        )
        assert (res.label_scores is None) == (alone.label_scores is None)
        for x, y in zip(res.label_scores or [], alone.label_scores or [], strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4


def answering_at_once(engine: Engine, hf, tok) -> tuple[list[dict[str, str]], list[int]]:  # type: ignore[no-untyped-def]
    """A question the model answers without opening its thinking (HF's greedy first token is not <think>)."""
    for content in ("What?", "Say no.", "ok", "Tell me more about it", "1 + 1"):
        ask = [{"role": "user", "content": content}]
        text = tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
        ids = list(tok(text, add_special_tokens=False).input_ids)
        if hf_greedy(hf, ids, 1)[0] != THINK:
            return ask, ids
    raise AssertionError("every question opens the thinking")


@torch.no_grad()
def test_before_thinking_opens_labels_score_at_the_prompt_and_a_grammar_allows_the_opening(reasoner) -> None:  # type: ignore[no-untyped-def]
    """Where the model may open its thinking or answer: a choices request that answers at once is scored at
    the prompt's end; a constrained one samples among what its grammar allows and <think>, as HF would."""
    engine, hf, tok = reasoner
    ask, ids = answering_at_once(engine, hf, tok)
    p = GenerationParams(max_new_tokens=20, temperature=0.0, choices=LABELS)
    (res,) = engine.generate([EngineRequest("direct", p, messages=ask)])
    assert res.reasoning_content == "" and res.reasoning_tokens == 0 and res.label_scores is not None
    for score, label in zip(res.label_scores, LABELS, strict=True):
        assert abs(score.logprob - hf_label_logprob(hf, ids, engine.prompts.label_ids((label,))[0])) < 1e-4
    regex = Constraint("regex", "(yes|no)")
    for question in (ask, THINK_ASK):
        text = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        q_ids = list(tok(text, add_special_tokens=False).input_ids)
        p = GenerationParams(max_new_tokens=20, temperature=0.0, constraint=regex, max_reasoning_tokens=3)
        (res,) = engine.generate([EngineRequest("re", p, messages=question)])
        first = hf(torch.tensor([q_ids])).logits[0, -1]
        allowed = [THINK, *tok("yn", add_special_tokens=False).input_ids]
        assert res.token_ids[0] == max(allowed, key=lambda t: float(first[t]))
        assert res.text in ("yes", "no")
        if res.token_ids[0] == THINK:  # it thought (under its budget), then answered under the grammar
            assert res.token_ids[:4] == hf_greedy(hf, q_ids, 4, forced={0: THINK, 3: END_THINK})
            assert res.reasoning_tokens == 4
        else:
            assert res.reasoning_content == "" and res.reasoning_tokens == 0


def test_samples_of_one_request_think_apart_and_a_choices_request_thinks_once(reasoner) -> None:  # type: ignore[no-untyped-def]
    engine, _, tok = reasoner
    res, labeled = engine.generate([
        chat("n", OPEN, n=3, temperature=1.0, seed=5, max_reasoning_tokens=4),
        chat("c", OPEN, n=2, choices=LABELS, max_reasoning_tokens=2),
    ])  # fmt: skip
    assert res.samples is not None and len(res.samples) == 3
    for s in res.samples:  # each its own thinking, closed by the model or at its budget
        end = s.token_ids.index(END_THINK)
        assert end <= 4 and s.reasoning_tokens == end + 1
        assert s.reasoning_content == decode(tok, s.token_ids[:end])
    assert labeled.samples is not None and len(labeled.samples) == 2
    assert {s.reasoning_content for s in labeled.samples} == {labeled.reasoning_content}
    assert all(s.text in LABELS for s in labeled.samples)
