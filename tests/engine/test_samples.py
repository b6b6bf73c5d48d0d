"""n > 1 and best_of on a tiny random Llama: the prompt computed once and shared, each sample's own seed
stream (the same alone or in a batch), greedy samples equal to HF, preemption, labels drawn n times."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from greedy_parity import check_greedy, hf_greedy
from transformers import AutoModelForCausalLM

from tests.engine.test_engine import BLOCK, engine_with, params, run_checked
from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import Constraint, GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine.samples import best_samples, sample_seed

PROMPT = [10, 11, 12, 13, 14, 15, 16]  # 7 tokens over blocks of 4: one full block shared, one partial copied


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def sampled(**kw: object) -> GenerationParams:
    base: dict[str, object] = {"temperature": 0.9, "top_p": 0.95, "seed": 77, "max_new_tokens": 16}
    return params(**{**base, **kw})


def others() -> list[EngineRequest]:
    return [
        EngineRequest(f"o{i}", params(temperature=1.0, seed=i, max_new_tokens=20), prompt_token_ids=[40 + i] * (3 + i))
        for i in range(5)
    ]  # fmt: skip


def tokens_of(res: EngineResult) -> list[list[int]]:
    assert res.samples is not None
    return [s.token_ids for s in res.samples]


def test_n4_seeded_samples_are_the_same_alone_and_in_a_batch(ckpt: Path) -> None:
    p = sampled(n=4, ignore_eos=True)
    alone = run_checked(engine_with(ckpt), [EngineRequest("t", p, prompt_token_ids=PROMPT)])[0]
    crowd = others()
    mixed = run_checked(
        engine_with(ckpt), [*crowd[:2], EngineRequest("t", p, prompt_token_ids=PROMPT), *crowd[2:]]
    )
    assert tokens_of(mixed[2]) == tokens_of(alone)
    assert len({tuple(t) for t in tokens_of(alone)}) == 4, "the samples share one seed stream"
    # sample 0 is the request with n=1 and the same seed; sample i is a request seeded sample_seed(seed, i)
    single = engine_with(ckpt).generate([
        EngineRequest(f"s{i}", dataclasses.replace(p, n=1, seed=sample_seed(77, i)), prompt_token_ids=PROMPT)
        for i in range(4)
    ])  # fmt: skip
    assert [r.token_ids for r in single] == tokens_of(alone)
    assert alone.text == alone.samples[0].text and alone.token_ids == alone.samples[0].token_ids  # type: ignore[index]
    assert alone.prompt_tokens == len(PROMPT) and alone.completion_tokens == 4 * 16


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_prompt_is_computed_once_for_every_sample(ckpt: Path, prefix_cache: bool) -> None:
    engine = engine_with(ckpt, prefix_cache=prefix_cache)
    res = run_checked(engine, [EngineRequest("t", sampled(n=4, max_new_tokens=6), prompt_token_ids=PROMPT)])[
        0
    ]
    stats = engine.stats()
    assert stats.prefill_tokens == len(PROMPT), "a sample recomputed the prompt"
    assert stats.prompt_tokens == len(PROMPT) and stats.cached_prompt_tokens == 0
    assert stats.tokens_generated == res.completion_tokens and len(res.samples or []) == 4


def test_forked_samples_share_the_full_prompt_blocks_and_copy_the_partial_one(ckpt: Path) -> None:
    engine = engine_with(ckpt)
    engine.add_request(
        EngineRequest("t", sampled(n=3, max_new_tokens=8, ignore_eos=True), prompt_token_ids=PROMPT)
    )
    engine.step()  # the prefill: the leader's prompt, then the two forks
    bm = engine.block_manager
    tables = [bm.block_table(s.request_id) for s in engine.scheduler.running]
    assert len(tables) == 3
    assert len({t[0] for t in tables}) == 1, "the full prompt block is not shared"
    assert len({t[1] for t in tables}) == 3, "the partial prompt block is shared by writers"
    # the copies hold the leader's K/V of the prompt tokens in that block (the slot axis follows the block's)
    axis = engine.model_runner._block_axis
    for k, v in engine.model_runner.kv_caches:
        for cache in (k, v):
            src = cache.select(axis, tables[0][1]).narrow(axis, 0, len(PROMPT) % BLOCK)
            for t in tables[1:]:
                assert torch.equal(src, cache.select(axis, t[1]).narrow(axis, 0, len(PROMPT) % BLOCK))
    while engine.has_work():
        engine.step()
        bm.check_invariants()
    assert bm.num_free == bm.num_blocks


def test_greedy_n2_samples_both_equal_hf_greedy(ckpt: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    prompts = [PROMPT, list(range(20, 28)), [5, 6, 7]]  # a partial last block, a full one, one block
    reqs = [EngineRequest(f"g{i}", params(temperature=0, n=2, max_new_tokens=14), prompt_token_ids=p)
            for i, p in enumerate(prompts)]  # fmt: skip
    results = run_checked(engine_with(ckpt), reqs)
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, 14)
        for sample in tokens_of(res):
            assert check_greedy(i, sample, theirs, logits) is None


def test_preempted_samples_resume_with_the_tokens_of_an_ample_pool(ckpt: Path) -> None:
    """A tiny pool under optimistic admission: samples (leaders before and after they fork, and forks)
    are preempted and recomputed, and every sample still has the tokens of a pool that never preempts."""
    reqs = [
        EngineRequest(
            f"r{i}",
            params(max_new_tokens=24, ignore_eos=True, temperature=0.0 if i == 2 else 0.8, seed=10 + i, n=2 + i % 2),
            prompt_token_ids=[3 + (7 * i + k) % 200 for k in range(3 + 2 * (i % 4))],
        )
        for i in range(8)
    ]  # fmt: skip
    big = run_checked(engine_with(ckpt, admission="reserve", repetition_window=0), reqs)
    small_engine = engine_with(ckpt, blocks=40, admission="optimistic", repetition_window=0)
    small = run_checked(small_engine, reqs)
    assert small_engine.scheduler.preemptions > 0, "the pool never ran out: make it smaller"
    assert [tokens_of(r) for r in small] == [tokens_of(r) for r in big]
    assert [(r.prompt_tokens, r.completion_tokens) for r in small] == [
        (r.prompt_tokens, r.completion_tokens) for r in big
    ]
    reserve = engine_with(ckpt, blocks=40, admission="reserve", repetition_window=0)
    assert [tokens_of(r) for r in run_checked(reserve, reqs)] == [tokens_of(r) for r in big]


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(ckpt: Path) -> None:
    p = sampled(n=2, best_of=5, temperature=1.2, logprobs=True, max_new_tokens=10, ignore_eos=True)
    res = engine_with(ckpt).generate([EngineRequest("b", p, prompt_token_ids=PROMPT)])[0]
    every = engine_with(ckpt).generate([EngineRequest("a", dataclasses.replace(p, n=5, best_of=None),
                                                      prompt_token_ids=PROMPT)])[0]  # fmt: skip
    assert every.samples is not None and res.samples is not None and len(res.samples) == 2
    # no EOS ends a sample (ignore_eos), so its logprobs shown are every term of its cumulative logprob
    ranks = [math.fsum(t.logprob for t in s.logprobs or []) for s in every.samples]
    order = best_samples(2, ranks)
    assert order != [0, 1], "the best two are the first two: pick another seed"
    assert [s.token_ids for s in res.samples] == [every.samples[i].token_ids for i in order]
    assert res.token_ids == every.samples[order[0]].token_ids
    assert res.completion_tokens == every.completion_tokens == 50  # every sample generated counts


def test_a_group_too_big_for_the_pool_fails_alone_naming_its_samples(ckpt: Path) -> None:
    engine: Engine = engine_with(ckpt, blocks=12, admission="reserve")
    too_big = EngineRequest("big", params(max_new_tokens=20, n=6), prompt_token_ids=PROMPT)
    fine = EngineRequest("ok", params(max_new_tokens=4, temperature=0), prompt_token_ids=PROMPT)
    big, ok = engine.generate([too_big, fine])
    assert big.finish_reason == "error" and big.error is not None and big.error.type == "kv_capacity"
    assert "6 samples" in big.error.message and "12 blocks" in big.error.message
    assert ok.finish_reason == "length"


def test_cancel_and_timeout_end_every_sample(ckpt: Path) -> None:
    engine = engine_with(ckpt)
    engine.add_request(
        EngineRequest("c", params(max_new_tokens=200, ignore_eos=True, n=3), prompt_token_ids=PROMPT)
    )
    engine.step()
    engine.step()
    engine.cancel("c")
    (res,) = engine.step()
    assert res.request_id == "c" and res.finish_reason == "cancelled"
    assert [s.finish_reason for s in res.samples or []] == ["cancelled"] * 3
    assert not engine.has_work() and engine.block_manager.num_free == engine.block_manager.num_blocks
    late = EngineRequest("t", params(max_new_tokens=50, n=2, timeout_s=1e-9), prompt_token_ids=PROMPT)
    (timed,) = engine.generate([late])
    assert [s.finish_reason for s in timed.samples or []] == ["timeout"] * 2


def test_choices_draw_n_labels_and_best_of_keeps_the_likeliest(ckpt: Path) -> None:
    labels = ("alpha", "beta", "gamma")
    p = params(choices=labels, temperature=20.0, seed=3, n=8)  # flat enough to draw several labels
    engine = engine_with(ckpt)
    res = engine.generate([EngineRequest("l", p, prompt_token_ids=PROMPT)])[0]
    single = engine.generate([EngineRequest("s", dataclasses.replace(p, n=1), prompt_token_ids=PROMPT)])[0]
    assert res.samples is not None and len(res.samples) == 8
    assert res.samples[0].text == single.text and res.label_scores == single.label_scores
    assert {s.text for s in res.samples} <= set(labels) and len({s.text for s in res.samples}) > 1
    assert res.completion_tokens == sum(s.completion_tokens for s in res.samples)
    best = engine.generate(
        [EngineRequest("b", dataclasses.replace(p, n=1, best_of=8), prompt_token_ids=PROMPT)]
    )[0]
    assert res.label_scores is not None and best.samples is not None
    top = max(
        {s.text for s in res.samples},
        key=lambda t: next(x.logprob for x in res.label_scores or [] if x.label == t),
    )
    assert best.text == top


def test_samples_never_run_more_sequences_than_max_num_seqs(ckpt: Path) -> None:
    engine = engine_with(ckpt, max_num_seqs=4)
    reqs = [
        EngineRequest(f"r{i}", params(max_new_tokens=6, n=3, seed=i), prompt_token_ids=PROMPT)
        for i in range(3)
    ]
    for r in reqs:
        engine.add_request(r)
    done = []
    while engine.has_work():
        done += engine.step()
        assert len(engine.scheduler.running) <= 4
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    (wide,) = engine.generate(
        [EngineRequest("w", params(max_new_tokens=6, n=2, best_of=5), prompt_token_ids=PROMPT)]
    )
    assert (
        wide.error is not None and "5 samples" in wide.error.message and "max_num_seqs" in wide.error.message
    )


def test_samples_of_a_sliding_window_model_equal_their_single_requests(tmp_path: Path) -> None:
    """Mistral windowed in every layer, a prompt past the window: forks share what the window still holds
    and each sample's tokens are those of the n=1 request with its seed."""
    path = build_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    engine = engine_with(path, admission="optimistic")
    assert engine.block_manager.window is not None
    prompt = [3 + (11 * k) % 200 for k in range(21)]
    p = sampled(n=3, ignore_eos=True, max_new_tokens=12)
    (res,) = run_checked(engine, [EngineRequest("w", p, prompt_token_ids=prompt)])
    assert engine.stats().prefill_tokens == len(prompt)
    single = run_checked(engine_with(path), [
        EngineRequest(f"s{i}", dataclasses.replace(p, n=1, seed=sample_seed(p.seed, i)), prompt_token_ids=prompt)
        for i in range(3)
    ])  # fmt: skip
    assert tokens_of(res) == [r.token_ids for r in single]


def test_each_sample_of_a_constrained_request_follows_the_grammar_on_its_own(ckpt: Path) -> None:
    regex = r"(yes|no|maybe), [0-9]{2}"
    c = Constraint("regex", regex)
    p = params(max_new_tokens=30, temperature=1.0, seed=8, constraint=c, n=6)
    engine = engine_with(ckpt)
    (res,) = run_checked(engine, [EngineRequest("g", p, prompt_token_ids=PROMPT)])
    texts = [s.text for s in res.samples or []]
    assert all(re.fullmatch(regex, t) for t in texts), texts
    assert len(set(texts)) > 1
    single = engine.generate([EngineRequest("s", dataclasses.replace(p, n=1, seed=sample_seed(8, 3)),
                                            prompt_token_ids=PROMPT)])  # fmt: skip
    assert single[0].text == texts[3]
