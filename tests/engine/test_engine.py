"""Engine behaviour on a tiny random Llama: pools, seeds, errors, cancel, timeout, the async front end."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.async_engine import AsyncEngine
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine_config import EngineConfig

BLOCK = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # 2 x layers x kv_heads x head_dim x float32 bytes x tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def engine_with(ckpt: Path, blocks: int = 2000, **kw: object) -> Engine:
    cfg = EngineConfig(
        dtype="float32",
        model=str(ckpt),
        block_size=BLOCK,
        kv_cache_gb=blocks * BLOCK_BYTES / 1024**3,
        **kw,  # type: ignore[arg-type]
    )
    engine = Engine.load(cfg)
    assert engine.block_manager.num_blocks == blocks
    return engine


def params(**kw: object) -> GenerationParams:
    kw.setdefault("max_new_tokens", 256)
    return GenerationParams(**kw)  # type: ignore[arg-type]


def workload(n: int) -> list[EngineRequest]:
    return [
        EngineRequest(
            f"r{i}",
            params(temperature=0, max_new_tokens=5 + 3 * (i % 7)),
            prompt_token_ids=[3 + i] * (4 + 5 * (i % 5)),
        )
        for i in range(n)
    ]


def run_checked(engine: Engine, reqs: list[EngineRequest]) -> list[EngineResult]:
    """generate(), asserting the pool invariants after every step."""
    for r in reqs:
        engine.add_request(r)
    done: dict[str, EngineResult] = {}
    while engine.has_work():
        for res in engine.step():
            done[res.request_id] = res
        engine.block_manager.check_invariants()
        stats = engine.stats()
        assert stats.kv_blocks_used <= stats.kv_blocks_total
        assert engine.block_manager.num_committed <= engine.block_manager.num_blocks
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return [done[r.request_id] for r in reqs]


def test_constrained_pool_completes_everything_with_identical_results(ckpt: Path) -> None:
    reqs = workload(24)
    big = run_checked(engine_with(ckpt), reqs)
    small_engine = engine_with(ckpt, blocks=12, max_num_seqs=5)
    small = run_checked(small_engine, workload(24))
    assert [r.token_ids for r in small] == [r.token_ids for r in big]
    assert all(r.finish_reason in ("length", "eos", "repetition") for r in small)
    assert small_engine.stats().steps > engine_with(ckpt).stats().steps


def test_seeded_sampling_is_independent_of_batch_composition(ckpt: Path) -> None:
    p = params(
        temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, seed=1234, max_new_tokens=24, ignore_eos=True
    )
    target = EngineRequest("target", p, prompt_token_ids=[10, 11, 12])
    alone = engine_with(ckpt).generate([target])[0]
    others = [
        EngineRequest(
            f"o{i}", params(temperature=1.0, max_new_tokens=30), prompt_token_ids=[50 + i] * (i + 1)
        )
        for i in range(6)
    ]
    mixed = engine_with(ckpt).generate(
        [*others[:3], EngineRequest("target", p, prompt_token_ids=[10, 11, 12]), *others[3:]]
    )
    assert mixed[3].token_ids == alone.token_ids
    other_seed = engine_with(ckpt).generate(
        [EngineRequest("t", dataclasses.replace(p, seed=99), prompt_token_ids=[10, 11, 12])]
    )
    assert other_seed[0].token_ids != alone.token_ids


def test_repetition_penalty_and_greedy_rows_mix(ckpt: Path) -> None:
    plain = EngineRequest(
        "plain", params(temperature=0, max_new_tokens=30, ignore_eos=True), prompt_token_ids=[7, 8]
    )
    pen = EngineRequest(
        "pen",
        params(temperature=0, max_new_tokens=30, repetition_penalty=5.0, ignore_eos=True),
        prompt_token_ids=[7, 8],
    )
    a, b = engine_with(ckpt, repetition_window=0).generate([plain, pen])
    assert len(set(b.token_ids)) >= len(set(a.token_ids))
    assert a.token_ids != b.token_ids


def test_request_errors_are_results_not_exceptions(ckpt: Path) -> None:
    engine = engine_with(ckpt, max_model_len=64)
    reqs = [
        EngineRequest("long", params(max_new_tokens=4), prompt_token_ids=[5] * 64),
        EngineRequest(
            "left",
            params(max_new_tokens=4, truncate_prompt="left", temperature=0),
            prompt_token_ids=[5] * 50 + [6] * 30,
        ),
        EngineRequest("none", params(max_new_tokens=4)),
        EngineRequest(
            "near-end", params(max_new_tokens=50, temperature=0, ignore_eos=True), prompt_token_ids=[5] * 60
        ),
        EngineRequest("beyond", params(max_new_tokens=65), prompt_token_ids=[5] * 3),  # more than the model
    ]
    long, left, none, near, beyond = engine.generate(reqs)
    huge_req = EngineRequest("huge", params(max_new_tokens=60), prompt_token_ids=[5] * 40)  # 25 blocks
    huge = engine_with(ckpt, blocks=20).generate([huge_req])[0]
    assert (
        long.finish_reason == "error"
        and long.error is not None
        and long.error.type == "prompt_too_long"
        and "64" in long.error.message
    )
    assert left.finish_reason == "length" and left.prompt_tokens == 60 and left.completion_tokens == 4
    assert (
        huge.error is not None
        and huge.error.type == "kv_capacity"
        and "25" in huge.error.message
        and "20" in huge.error.message
    )
    assert none.error is not None and none.error.type == "invalid_request"
    assert near.finish_reason == "length" and near.completion_tokens == 4  # capped at the context end
    assert beyond.error is not None and beyond.error.type == "context_length_exceeded"
    assert beyond.error.message == (
        "max_new_tokens is 65, but the model holds 64 tokens in all (prompt and output together; this "
        "prompt has 3)"
    )


def test_chat_request_without_chat_template_is_invalid(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "m", "llama", chat_template=False)
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.001))
    res = engine.generate([EngineRequest("c", params(), messages=[{"role": "user", "content": "hi"}])])[0]
    assert (
        res.finish_reason == "error"
        and res.error is not None
        and res.error.type == "invalid_request"
        and "chat template" in res.error.message
    )


def test_timeout_and_cancel_keep_partial_output(ckpt: Path) -> None:
    engine = engine_with(ckpt)
    long = params(temperature=0, max_new_tokens=200, ignore_eos=True)
    engine.add_request(
        EngineRequest("late", params(timeout_s=1.0), prompt_token_ids=[5], started_at=time.monotonic() - 5)
    )
    engine.add_request(EngineRequest("cancel-me", long, prompt_token_ids=[5, 6]))
    engine.add_request(
        EngineRequest("keep", dataclasses.replace(long, max_new_tokens=12), prompt_token_ids=[5, 6])
    )
    results = {r.request_id: r for r in engine.step()}
    assert results["late"].finish_reason == "timeout" and results["late"].completion_tokens == 0
    for _ in range(5):
        engine.step()
    engine.cancel("cancel-me")
    results = {r.request_id: r for r in engine.step()}
    cancelled = results["cancel-me"]
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens == 6
    done = engine.generate([])
    assert done == [] and not engine.has_work()


async def test_async_engine_keeps_the_event_loop_responsive(ckpt: Path) -> None:
    def loader(cfg: EngineConfig) -> Engine:
        engine = Engine.load(cfg)
        real_step = engine.step

        def slow_step() -> list[EngineResult]:
            time.sleep(0.2)  # stands in for a long forward pass
            return real_step()

        engine.step = slow_step  # type: ignore[method-assign]
        return engine

    cfg = EngineConfig(dtype="float32", model=str(ckpt), block_size=BLOCK, kv_cache_gb=0.01)
    aeng = await AsyncEngine.load(cfg, loader=loader)
    fut = aeng.submit(
        EngineRequest("a", params(temperature=0, max_new_tokens=4, ignore_eos=True), prompt_token_ids=[5, 6])
    )
    victim = aeng.submit(
        EngineRequest("b", params(max_new_tokens=200, ignore_eos=True), prompt_token_ids=[5])
    )
    ticks, t0 = 0, time.monotonic()
    while not fut.done():
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks >= 0.5 * (time.monotonic() - t0) / 0.01 * 0.5  # the loop kept ticking during compute
    assert (await fut).finish_reason == "length"
    aeng.cancel("b")
    res = await asyncio.wait_for(victim, 5)
    assert res.finish_reason == "cancelled" and aeng.last_progress > t0
    await aeng.stop()


async def test_async_engine_loads_the_model_on_the_thread_that_steps_it(ckpt: Path) -> None:
    # One thread for every torch call: a second thread's OpenMP team made decode steps ~1.9x slower.
    threads: dict[str, threading.Thread] = {}

    def loader(cfg: EngineConfig) -> Engine:
        threads["load"] = threading.current_thread()
        engine = Engine.load(cfg)
        real_step = engine.step

        def step() -> list[EngineResult]:
            threads["step"] = threading.current_thread()
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        return engine

    cfg = EngineConfig(dtype="float32", model=str(ckpt), block_size=BLOCK, kv_cache_gb=0.01)
    aeng = await AsyncEngine.load(cfg, loader=loader)
    res = await aeng.submit(EngineRequest("a", params(temperature=0, max_new_tokens=3), prompt_token_ids=[5]))
    await aeng.stop()
    assert res.completion_tokens >= 1
    assert threads["load"] is threads["step"] is not threading.main_thread()


async def test_async_engine_load_errors_reach_the_caller(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        await AsyncEngine.load(EngineConfig(dtype="float32", model=str(tmp_path / "missing")))


def test_optimistic_admission_preempts_and_resumes_with_identical_tokens(ckpt: Path) -> None:
    """A pool far too small for the worst cases: sequences are preempted mid-generation, resumed by
    recomputing prompt + output, and still produce exactly the tokens of a pool that never preempts."""
    reqs = [
        EngineRequest(
            f"r{i}",
            params(
                max_new_tokens=30 + i % 5, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=100 + i
            ),
            prompt_token_ids=[3 + (5 * i + k) % 200 for k in range(6 + 3 * (i % 4))],
        )
        for i in range(12)
    ]
    big = run_checked(engine_with(ckpt, admission="reserve", repetition_window=0), reqs)
    small_engine = engine_with(ckpt, blocks=40, admission="optimistic", repetition_window=0, max_num_seqs=12)
    small = run_checked(small_engine, reqs)
    assert small_engine.scheduler.preemptions > 0, "the pool never ran out: make it smaller"
    assert [r.token_ids for r in small] == [r.token_ids for r in big]
    assert [r.text for r in small] == [r.text for r in big]
    assert [(r.prompt_tokens, r.completion_tokens) for r in small] == [
        (r.prompt_tokens, r.completion_tokens) for r in big
    ]


def test_optimistic_admission_holds_more_sequences_than_reserving(ckpt: Path) -> None:
    # Requests that may write 60 tokens but stop at their first (every token is a stop token): reserving
    # the worst case admits 3 at a time; the measured ratio soon packs the pool.
    stop_any = list(range(259))
    reqs = [EngineRequest(f"r{i}", params(max_new_tokens=60, stop_token_ids=stop_any), prompt_token_ids=[5 + i] * 8)
            for i in range(40)]  # fmt: skip
    peak = {}
    for admission in ("reserve", "optimistic"):
        engine = engine_with(ckpt, blocks=60, admission=admission, max_num_seqs=16)
        for r in reqs:
            engine.add_request(r)
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, engine.stats().running)
        peak[admission] = most
    assert peak["reserve"] <= 3 and peak["optimistic"] >= 2 * peak["reserve"], peak


def test_a_preempted_request_keeps_its_deadline(ckpt: Path) -> None:
    engine = engine_with(ckpt, blocks=40, admission="optimistic", repetition_window=0, max_num_seqs=8)
    long = [EngineRequest(f"l{i}", params(max_new_tokens=40, ignore_eos=True, temperature=0.0),
                          prompt_token_ids=[9 + i] * 20) for i in range(6)]  # fmt: skip
    late = EngineRequest("late", params(max_new_tokens=40, ignore_eos=True, timeout_s=0.5), prompt_token_ids=[4] * 20,
                         started_at=time.monotonic() - 10)  # fmt: skip
    results = {r.request_id: r for r in engine.generate([*long, late])}
    assert results["late"].finish_reason == "timeout"


def test_openai_penalties_pick_the_argmax_of_the_penalised_logits(ckpt: Path) -> None:
    # OpenAI semantics: logit[t] - frequency x count(t in the output so far) - presence x [count > 0].
    # The raw top-20 log-probabilities (before penalties) hold the penalised argmax while fewer than 20
    # distinct tokens were generated (an unpenalised top-20 token beats every token outside it). The
    # alternatives carry bytes, not ids: a token is recognised by its bytes (byte-level BPE: distinct).
    p = params(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=20)
    cases = {"freq": (0.0, 1.5), "pres": (1.0, 0.0), "both": (0.5, -0.5)}
    reqs = [EngineRequest("plain", p, prompt_token_ids=[7, 8, 9])] + [
        EngineRequest(
            k, dataclasses.replace(p, presence_penalty=pr, frequency_penalty=fr), prompt_token_ids=[7, 8, 9]
        )
        for k, (pr, fr) in cases.items()
    ]
    plain, *penalised = engine_with(ckpt, repetition_window=0).generate(reqs)
    assert penalised[0].token_ids != plain.token_ids  # the penalties do something here
    for res, (pres, freq) in zip(penalised, cases.values(), strict=True):
        assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids) == 16
        for j, lp in enumerate(res.logprobs):
            before = [prev.bytes for prev in res.logprobs[:j]]
            chosen = _penalised(lp.logprob, lp.bytes, before, pres, freq)
            best = max(_penalised(c.logprob, c.bytes, before, pres, freq) for c in lp.top)
            assert chosen >= best - 1e-5, (res.request_id, j, chosen, best)


def _penalised(
    logprob: float, token_bytes: list[int], before: list[list[int]], pres: float, freq: float
) -> float:
    n = before.count(token_bytes)
    return logprob - freq * n - (pres if n else 0.0)


def test_logit_bias_forces_and_bans_tokens(ckpt: Path) -> None:
    p = params(temperature=0, max_new_tokens=8, ignore_eos=True)
    engine = engine_with(ckpt, repetition_window=0)
    plain = engine.generate([EngineRequest("plain", p, prompt_token_ids=[7, 8, 9])])[0]
    banned = plain.token_ids[0]
    forced, ban = engine.generate(
        [
            EngineRequest(
                "forced", dataclasses.replace(p, logit_bias=((42, 100.0),)), prompt_token_ids=[7, 8, 9]
            ),
            EngineRequest(
                "ban", dataclasses.replace(p, logit_bias=((banned, -100.0),)), prompt_token_ids=[7, 8, 9]
            ),
        ]
    )
    assert forced.token_ids == [42] * 8
    assert banned not in ban.token_ids
    (bad,) = engine.generate(
        [EngineRequest("bad", dataclasses.replace(p, logit_bias=((10**6, 1.0),)), prompt_token_ids=[7])]
    )
    assert bad.finish_reason == "error" and bad.error is not None and "logit_bias" in bad.error.message
