"""What a reasoning model's `choices` request reserves in a short context: its thinking budget, the close the
budget forces, its longest label and EOS, not max_new_tokens (issue 58, item 9); where that does not fit,
the refusal names each part. Free text is never refused for its max_new_tokens: it is cut at the context's
end.

The tiny random Qwen3 of tests/tiny_models.build_think_checkpoint (a tokenizer with <think> and </think>),
served with max_model_len=256: THINK_ASK's prompt (38 tokens) never fits beside the default max_new_tokens
(256).
"""

from __future__ import annotations

import pytest

from producer.wire.request_params import BUILTIN_DEFAULTS
from tests.tiny_models import OPEN, THINK_ASK, build_think_checkpoint, think_prompt_ids, think_tokenizer
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.reasoning import ReasoningMarkers
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig

LABELS = ("positive", "negative", "neutral")  # the longest is 8 tokens (bytes)
CONTEXT = 256
DEFAULT_NEW = BUILTIN_DEFAULTS["max_new_tokens"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine]:
    """The think model served with a context of 256, and the same model with its own long one."""
    path = build_think_checkpoint(tmp_path_factory.mktemp("think"))
    cfg = EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.02, block_size=8)
    short = Engine.load(cfg.model_copy(update={"max_model_len": CONTEXT}))
    assert short.max_model_len == CONTEXT and short.reasoning is not None
    return short, Engine.load(cfg)


def chat(rid: str, kwargs: dict[str, object] | None = OPEN, **params: object) -> EngineRequest:
    p = GenerationParams(**{"max_new_tokens": DEFAULT_NEW, "temperature": 0.0, **params})  # type: ignore[arg-type]
    return EngineRequest(rid, p, messages=THINK_ASK, chat_template_kwargs=kwargs)


PROMPT = len(think_prompt_ids(think_tokenizer(), **OPEN))


@pytest.mark.parametrize("kwargs", [OPEN, None], ids=["prompt-opens-thinking", "model-opens-thinking"])
def test_a_thinking_choices_request_with_the_default_max_new_tokens_fits_a_short_context(
    engines: tuple[Engine, Engine], kwargs: dict[str, object] | None
) -> None:
    short, long = engines
    req = chat("budget", kwargs, choices=LABELS, max_reasoning_tokens=3)
    (res,) = short.generate([req])
    assert res.error is None, res.error
    (want,) = long.generate([req])  # the same request where the context is no question
    assert res.label_scores is not None and want.label_scores is not None
    assert (res.text, res.token_ids, res.reasoning_content) == (
        want.text,
        want.token_ids,
        want.reasoning_content,
    )
    for got, ref in zip(res.label_scores, want.label_scores, strict=True):
        assert abs(got.logprob - ref.logprob) < 1e-5
    # What it reserves (admission: ceil((prompt + max_new_tokens) / block)) is what it can generate: the
    # budget, the close, the longest label and EOS
    seq = short.prompts.sequence(req, 0.0)
    assert seq.max_new_tokens == 3 + 1 + 8 + 1 and seq.max_total_tokens == seq.prompt_len + 13
    assert len(res.token_ids) <= seq.max_new_tokens


def test_a_thinking_budget_that_does_not_fit_is_refused_naming_each_part(
    engines: tuple[Engine, Engine],
) -> None:
    short, _ = engines
    budget = CONTEXT - PROMPT - 1 - 8 - 1  # prompt + budget + close + label + EOS: the whole context
    fits, over = short.generate([
        chat("fits", choices=LABELS, max_reasoning_tokens=budget),
        chat("over", choices=LABELS, max_reasoning_tokens=budget + 1),
    ])  # fmt: skip
    assert fits.error is None and fits.label_scores is not None and fits.finish_reason == "eos"
    assert over.error is not None and over.error.type == "prompt_too_long"
    assert over.error.message == (
        f"prompt {PROMPT} tokens + reserved output {budget + 11} tokens (thinking budget {budget + 1} + close 1 + "
        "longest label 8 + EOS 1) = 257 > the model context 256 (set truncate_prompt to 'left' or 'right' to "
        "cut the prompt)"
    )


def test_thinking_without_a_budget_reserves_max_new_tokens_and_says_so(
    engines: tuple[Engine, Engine],
) -> None:
    """No budget: max_new_tokens is what bounds the thinking, so it is what a label must fit after."""
    short, _ = engines
    (res,) = short.generate([chat("unbounded", choices=LABELS)])
    assert res.error is not None and res.error.type == "prompt_too_long"
    assert res.error.message == (
        f"prompt {PROMPT} tokens + reserved output {DEFAULT_NEW + 9} tokens (thinking up to max_new_tokens "
        f"{DEFAULT_NEW} + longest label 8 + EOS 1) = {PROMPT + DEFAULT_NEW + 9} > the model context 256 (set "
        "truncate_prompt to 'left' or 'right' to cut the prompt)"
    )
    (small,) = short.generate([chat("small", choices=LABELS, max_new_tokens=CONTEXT - PROMPT - 9)])
    assert small.error is None and small.label_scores is not None


def test_free_text_with_a_thinking_budget_is_cut_at_the_context_end_not_refused(
    engines: tuple[Engine, Engine],
) -> None:
    """The same budget on a free-text request: nothing is reserved beyond the context; the output runs
    until it ends on its own or the context does (as every free-text request)."""
    short, _ = engines
    req = chat("free", max_reasoning_tokens=CONTEXT)
    (res,) = short.generate([req])
    assert res.error is None and res.prompt_tokens + res.completion_tokens <= CONTEXT
    assert short.prompts.sequence(req, 0.0).max_new_tokens == CONTEXT - PROMPT


@pytest.mark.parametrize("kind", ["think", "harmony"])
@pytest.mark.parametrize("opened", [True, False], ids=["prompt-opens", "model-opens"])
@pytest.mark.parametrize("budget", [0, 1, 2, 5])
def test_the_reserved_thinking_bounds_what_a_budget_lets_the_model_generate(
    kind: str, opened: bool, budget: int
) -> None:
    """ReasoningState.close_bound, against the state machine itself: a model that never closes its thinking
    (the worst case) is closed by its budget within the bound, exactly at it for think markers."""
    from tests.engine.test_reasoning_markers import harmony_tokenizer, ids

    tok = think_tokenizer() if kind == "think" else harmony_tokenizer()
    markers = ReasoningMarkers.detect(tok, None, kind)
    assert markers is not None
    if kind == "think":
        prompt = ids(tok, "q</s>\n<s>assistant\n" + ("<think>\n" if opened else ""))
        writes = [] if opened else [markers.start]
    else:
        prompt = ids(tok, "<|start|>assistant" + ("<|channel|>analysis<|message|>" if opened else ""))
        writes = [] if opened else ids(tok, "<|channel|>analysis<|message|>")
    state = markers.state(prompt, budget)
    bound = state.close_bound()
    assert bound is not None and bound[0] == budget
    stream = iter([*writes, *ids(tok, "a" * 100)])  # thinking on and on
    generated = 0
    while not state.in_answer:
        state.feed(state.next_token(next(stream)))
        generated += 1
    assert generated <= sum(bound)
    if kind == "think":
        assert generated == sum(bound)
