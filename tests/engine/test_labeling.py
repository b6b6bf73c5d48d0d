"""Labeling outputs against HF transformers in float32: token logprobs, label scores, constraints.

Every token logprob must equal HF's log_softmax at that position within 1e-4, every label score the
HF teacher-forced sum (label tokens, then the first EOS) within 1e-4; results must not depend on what
else is in the batch; a random model under a JSON schema or a regex must produce matching output.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import Constraint, GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine_config import EngineConfig

TOL = 1e-4
LABELS = ("positive", "negative", "neutral", "pos", "mixed feelings")  # "pos" shares a prefix with "positive"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, object]:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen2", seed=3)
    engine = Engine.load(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.02, block_size=8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return engine, hf


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """log_softmax of HF's logits at every position of `ids`: [len, vocab]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_label_logprob(hf, prompt: list[int], label: list[int], eos: int) -> float:  # type: ignore[no-untyped-def]
    lp = hf_logprobs(hf, prompt + label)
    targets = [*label, eos]
    return sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(targets))


def check_token_logprobs(engine: Engine, hf, prompt: list[int], res: EngineResult, top: int) -> None:  # type: ignore[no-untyped-def]
    assert res.logprobs is not None
    lp = hf_logprobs(hf, prompt + res.token_ids)
    assert len(res.logprobs) == len(res.token_ids) - (res.finish_reason == "eos")  # a final EOS is not shown
    for i, entry in enumerate(res.logprobs):
        row = lp[len(prompt) - 1 + i]
        tok = res.token_ids[i]
        assert abs(entry.logprob - float(row[tok])) < TOL, (i, entry.logprob, float(row[tok]))
        assert entry.bytes == list(engine.grammars.token_bytes(tok))
        assert len(entry.top) == top
        want = row.topk(top)
        for choice, value in zip(entry.top, want.values.tolist(), strict=True):
            assert abs(choice.logprob - value) < TOL
        assert [c.logprob for c in entry.top] == sorted((c.logprob for c in entry.top), reverse=True)


def check_labels_and_logprobs_match_hf(engine: Engine, hf) -> None:  # type: ignore[no-untyped-def]
    """Greedy tokens' logprobs (top 3) and every label's score on PROMPTS, one batch, against HF's
    teacher-forced numbers: what each model family must get right (tests/engine/test_tiny_models.py,
    test_transformers_fallback.py)."""
    eos = engine.eos_token_ids[0]
    lp = GenerationParams(max_new_tokens=10, temperature=0.0, logprobs=True, top_logprobs=3)
    choose = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)
    reqs = [EngineRequest(f"{kind}{i}", params, prompt_token_ids=p)
            for i, p in enumerate(PROMPTS) for kind, params in (("lp", lp), ("c", choose))]  # fmt: skip
    results = engine.generate(reqs)
    for i, prompt in enumerate(PROMPTS):
        check_token_logprobs(engine, hf, prompt, results[2 * i], 3)
        scores = results[2 * i + 1].label_scores
        assert scores is not None
        for s, label in zip(scores, engine.prompts.label_ids(LABELS), strict=True):
            assert abs(s.logprob - hf_label_logprob(hf, prompt, label, eos)) < 1e-4, s


def labels_of(engine: Engine) -> list[list[int]]:
    return engine.prompts.label_ids(LABELS)


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 43)), [200, 100] * 12 + [7]]  # 5, 33 (> block boundaries), 25


def test_token_logprobs_equal_hf_log_softmax(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, hf = tiny
    for top in (0, 5):
        reqs = [EngineRequest(f"p{i}-{top}", GenerationParams(max_new_tokens=12, temperature=0.0, logprobs=True,
                              top_logprobs=top), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]  # fmt: skip
        for prompt, res in zip(PROMPTS, engine.generate(reqs), strict=True):
            check_token_logprobs(engine, hf, prompt, res, top)


def test_sampled_tokens_report_their_raw_logprob(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, hf = tiny
    p = GenerationParams(max_new_tokens=10, temperature=1.3, top_k=20, seed=7, logprobs=True, top_logprobs=2)
    res = engine.generate([EngineRequest("s", p, prompt_token_ids=PROMPTS[1])])[0]
    check_token_logprobs(engine, hf, PROMPTS[1], res, 2)  # before temperature and top-k


def test_label_scores_equal_the_hf_teacher_forced_sum(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, hf = tiny
    eos = engine.eos_token_ids[0]
    reqs = [EngineRequest(f"c{i}", GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS),
                          prompt_token_ids=p) for i, p in enumerate(PROMPTS)]  # fmt: skip
    before = engine.stats()
    results = engine.generate(reqs)
    after = engine.stats()
    # The label rows ran as scoring steps, counted and timed as such (not as prefill or decode).
    assert after.score_steps > before.score_steps and after.score_s > before.score_s
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.label_scores is not None and [s.label for s in res.label_scores] == list(LABELS)
        for s, label in zip(res.label_scores, labels_of(engine), strict=True):
            assert abs(s.logprob - hf_label_logprob(hf, prompt, label, eos)) < TOL, s
        assert abs(sum(s.prob for s in res.label_scores) - 1.0) < 1e-9
        best = max(res.label_scores, key=lambda s: s.logprob)
        assert res.text == best.label and res.finish_reason == "eos"
        chosen = labels_of(engine)[LABELS.index(best.label)]
        assert res.token_ids == [*chosen, eos] and res.completion_tokens == len(chosen) + 1
        assert res.prompt_tokens == len(prompt)


def test_a_sampled_label_follows_the_seed(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, _ = tiny
    picks = []
    for seed in range(40):  # a very hot temperature: nearly uniform draws over the labels
        p = GenerationParams(max_new_tokens=1, temperature=1e4, seed=seed, choices=LABELS)
        picks.append(engine.generate([EngineRequest(f"t{seed}", p, prompt_token_ids=PROMPTS[0])])[0].text)
    p = GenerationParams(max_new_tokens=1, temperature=1e4, seed=3, choices=LABELS)
    again = engine.generate([EngineRequest("again", p, prompt_token_ids=PROMPTS[0])])
    assert again[0].text == picks[3]  # the same seed, the same label
    assert len(set(picks)) >= 3


SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                    "ok": {"type": "boolean"}}, "required": ["name", "ok"],
                   "additionalProperties": False},
    },
    "required": ["label", "score", "tags", "author"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"(yes|no)\. [0-9]{1,3} points?"


def test_a_random_model_under_a_schema_writes_valid_json_for_100_seeds(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, _ = tiny
    c = Constraint("json_schema", json.dumps(SCHEMA))
    reqs = [EngineRequest(f"j{seed}", GenerationParams(max_new_tokens=120, temperature=1.0, seed=seed, constraint=c),
                          prompt_token_ids=[3 + seed % 200, 9]) for seed in range(100)]  # fmt: skip
    results = engine.generate(reqs)
    done = [r for r in results if r.finish_reason != "length"]
    assert all(r.finish_reason in ("stop", "eos") for r in done), {r.finish_reason for r in results}
    for r in done:
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert len(done) >= 50, f"only {len(done)} of 100 finished within 120 tokens"
    assert engine.grammars.compiled <= 2  # one schema, compiled once (the regex test may add one)


def test_a_random_model_under_a_regex_matches_it_for_100_seeds(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, _ = tiny
    c = Constraint("regex", REGEX)
    reqs = [EngineRequest(f"r{seed}", GenerationParams(max_new_tokens=40, temperature=1.0, seed=seed, constraint=c),
                          prompt_token_ids=[5, seed % 250 + 3]) for seed in range(100)]  # fmt: skip
    for r in engine.generate(reqs):
        assert r.finish_reason == "length" or re.fullmatch(REGEX, r.text), (r.finish_reason, r.text)


def test_results_are_the_same_alone_and_in_a_mixed_batch(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, _ = tiny
    c = Constraint("json_schema", json.dumps(SCHEMA))
    make = [
        lambda i: EngineRequest(f"free{i}", GenerationParams(max_new_tokens=9, temperature=0.0), prompt_token_ids=PROMPTS[0]),
        lambda i: EngineRequest(f"choice{i}", GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS),
                                prompt_token_ids=PROMPTS[1]),
        lambda i: EngineRequest(f"schema{i}", GenerationParams(max_new_tokens=60, temperature=0.7, seed=5, constraint=c),
                                prompt_token_ids=PROMPTS[2]),
        lambda i: EngineRequest(f"lp{i}", GenerationParams(max_new_tokens=7, temperature=0.0, logprobs=True, top_logprobs=3),
                                prompt_token_ids=PROMPTS[1]),
    ]  # fmt: skip
    alone = [engine.generate([m(0)])[0] for m in make]
    mixed = engine.generate([m(1) for m in make])
    for a, b in zip(alone, mixed, strict=True):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    for a, b in zip(alone[1].label_scores or [], mixed[1].label_scores or [], strict=True):
        assert abs(a.logprob - b.logprob) < TOL
    for a, b in zip(alone[3].logprobs or [], mixed[3].logprobs or [], strict=True):
        assert abs(a.logprob - b.logprob) < TOL and [c.token for c in a.top] == [c.token for c in b.top]


@pytest.mark.parametrize(
    ("params", "error_type"),
    [
        ({"constraint": Constraint("json_schema", '{"type": "nonsense"}')}, "invalid_schema"),
        ({"constraint": Constraint("regex", "(unclosed")}, "invalid_regex"),
        ({"choices": ("ok", "x" * 400)}, "invalid_choices"),  # 400 byte tokens: over the label limit
    ],
)
def test_a_request_the_grammar_or_labels_cannot_take_fails_alone(
    tiny, params: dict[str, object], error_type: str
) -> None:  # type: ignore[no-untyped-def]
    engine, _ = tiny
    bad = EngineRequest(
        "bad", GenerationParams(max_new_tokens=4, temperature=0.0, **params), prompt_token_ids=[5, 6]
    )  # type: ignore[arg-type]
    good = EngineRequest("good", GenerationParams(max_new_tokens=4, temperature=0.0), prompt_token_ids=[5, 6])
    res_bad, res_good = engine.generate([bad, good])
    assert res_bad.finish_reason == "error" and res_bad.error is not None and res_bad.error.type == error_type
    assert res_good.finish_reason in ("length", "eos") and res_good.completion_tokens >= 1


def test_prompts_split_into_chunks_beside_decode_rows_keep_hf_logprobs_and_scores(tiny) -> None:  # type: ignore[no-untyped-def]
    """A 6-token step budget: each prompt is computed over several steps, in the same forward passes as
    other sequences' decode rows ("mixed" steps). Logprobs and label scores must still equal HF's."""
    engine, hf = tiny
    small = Engine.load(engine.cfg.model_copy(update={"max_num_batched_tokens": 6, "max_num_seqs": 4}))
    steps: list[tuple[str, int, tuple[int, ...]]] = []
    schedule = small.scheduler.schedule

    def recorded():  # type: ignore[no-untyped-def]
        batch = schedule()
        if batch is not None:
            steps.append((batch.phase, batch.num_decode, tuple(batch.chunks)))
        return batch

    small.scheduler.schedule = recorded  # type: ignore[method-assign]
    lp = [EngineRequest(f"lp{i}", GenerationParams(max_new_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3),
                        prompt_token_ids=p) for i, p in enumerate(PROMPTS)]  # fmt: skip
    ch = [EngineRequest(f"ch{i}", GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS),
                        prompt_token_ids=p) for i, p in enumerate(PROMPTS)]  # fmt: skip
    results = small.generate([lp[0], ch[1], lp[1], ch[2], lp[2], ch[0]])
    assert any(phase == "mixed" and nd > 0 and chunks for phase, nd, chunks in steps), steps
    assert all(sum(chunks) + nd <= 6 for phase, nd, chunks in steps if phase != "score")
    eos = small.eos_token_ids[0]
    for res in results:
        prompt = PROMPTS[int(res.request_id[2])]
        if res.request_id.startswith("lp"):
            check_token_logprobs(small, hf, prompt, res, 3)
            continue
        assert res.label_scores is not None
        for s, label in zip(res.label_scores, labels_of(small), strict=True):
            assert abs(s.logprob - hf_label_logprob(hf, prompt, label, eos)) < TOL, s


def check_label_logprobs(engine: Engine, hf, prompt: list[int], res: EngineResult, top: int) -> None:  # type: ignore[no-untyped-def]
    """A `choices` result's logprobs: its label's tokens then EOS, each with the teacher-forced term of the
    label's score (HF's log_softmax at that position) and HF's top alternatives there."""
    assert res.logprobs is not None and res.label_scores is not None
    eos = engine.eos_token_ids[0]
    label = engine.prompts.label_ids([res.text])[0]
    assert res.token_ids == [*label, eos]
    assert len(res.logprobs) == len(label) + 1  # the EOS is a term of the score: shown
    lp = hf_logprobs(hf, prompt + label)
    for i, (entry, tok) in enumerate(zip(res.logprobs, res.token_ids, strict=True)):
        row = lp[len(prompt) - 1 + i]
        assert entry.bytes == list(engine.grammars.token_bytes(tok))
        assert entry.token == engine.token_texts(tok)[0]
        assert abs(entry.logprob - float(row[tok])) < TOL, (i, entry.logprob, float(row[tok]))
        assert len(entry.top) == top
        assert [c.logprob for c in entry.top] == sorted((c.logprob for c in entry.top), reverse=True)
        want = row.topk(top)
        for choice, value, tid in zip(entry.top, want.values.tolist(), want.indices.tolist(), strict=True):
            assert abs(choice.logprob - value) < TOL
            if sum(abs(value - v) < 1e-3 for v in row.tolist()) == 1:  # no near-tie: the token is decided
                assert choice.bytes == list(engine.grammars.token_bytes(tid))
        if top:
            assert entry.top[0].logprob >= entry.logprob
    chosen = next(s for s in res.label_scores if s.label == res.text)
    assert math.isclose(sum(e.logprob for e in res.logprobs), chosen.logprob, rel_tol=1e-5, abs_tol=1e-6)


def test_a_choices_request_with_logprobs_gets_its_labels_teacher_forced_terms(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, hf = tiny
    reqs = [EngineRequest(f"cl{i}", GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS, logprobs=True,
                          top_logprobs=3), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]  # fmt: skip
    for prompt, res in zip(PROMPTS, engine.generate(reqs), strict=True):
        assert res.text == max(res.label_scores or [], key=lambda s: s.logprob).label
        check_label_logprobs(engine, hf, prompt, res, 3)


def test_label_logprobs_in_one_score_step_follow_each_requests_params(tiny) -> None:  # type: ignore[no-untyped-def]
    """Choices requests asking for no logprobs, logprobs alone, and different top_logprobs, scored in one
    pass: each gets what it asked for, and its numbers are its own label's."""
    engine, hf = tiny
    asks = [(False, 0), (True, 5), (True, 0), (True, 2), (False, 0)]
    reqs = [EngineRequest(f"mix{i}", GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS, logprobs=lp,
                          top_logprobs=k), prompt_token_ids=PROMPTS[i % 3]) for i, (lp, k) in enumerate(asks)]  # fmt: skip
    before = engine.stats().score_steps
    results = engine.generate(reqs)
    assert engine.stats().score_steps == before + 1  # all in one packed pass
    for i, ((lp, k), res) in enumerate(zip(asks, results, strict=True)):
        if not lp:
            assert res.logprobs is None
            continue
        check_label_logprobs(engine, hf, PROMPTS[i % 3], res, k)


def test_labels_sharing_a_prefix_each_report_their_own_terms(tiny) -> None:  # type: ignore[no-untyped-def]
    """Labels "pos" and "positive" share their first three tokens: whichever is drawn reports its own
    tokens and terms, the shared ones equal, the fourth the EOS for "pos" and "i" for "positive"."""
    engine, hf = tiny
    by_label: dict[str, EngineResult] = {}
    for seed in range(40):  # a very hot temperature: nearly uniform draws between the two labels
        p = GenerationParams(max_new_tokens=1, temperature=1e4, seed=seed, choices=("positive", "pos"),
                             logprobs=True, top_logprobs=4)  # fmt: skip
        res = engine.generate([EngineRequest(f"pre{seed}", p, prompt_token_ids=PROMPTS[2])])[0]
        check_label_logprobs(engine, hf, PROMPTS[2], res, 4)
        by_label.setdefault(res.text, res)
        if len(by_label) == 2:
            break
    assert set(by_label) == {"pos", "positive"}
    short, long_ = by_label["pos"].logprobs, by_label["positive"].logprobs
    assert short is not None and long_ is not None and (len(short), len(long_)) == (4, 9)
    for a, b in zip(short[:3], long_[:3], strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < TOL
    eos = engine.eos_token_ids[0]
    assert short[3].bytes == list(engine.grammars.token_bytes(eos)) and long_[3].token == "i"
    for a, b in zip(short[3].top, long_[3].top, strict=True):  # the same position: the same alternatives
        assert abs(a.logprob - b.logprob) < TOL
    assert abs(short[3].logprob - long_[3].logprob) > 1e-6  # two different targets there


def test_choices_logprobs_without_top_logprobs_have_empty_top_lists(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, hf = tiny
    p = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS, logprobs=True)
    res = engine.generate([EngineRequest("notop", p, prompt_token_ids=PROMPTS[1])])[0]
    check_label_logprobs(engine, hf, PROMPTS[1], res, 0)
    assert res.logprobs and all(e.top == [] for e in res.logprobs)
