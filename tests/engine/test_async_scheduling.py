"""Async scheduling (EngineConfig.async_scheduling): decode steps launched on the device thread before the
step before them is taken give the serial engine's outputs, token for token, whatever shares the batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import Constraint, GenerationParams
from worker.engine.request import EngineError, EngineRequest, EngineResult
from worker.engine_config import EngineConfig

BLOCK = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # 2 x layers x kv_heads x head_dim x float32 bytes x tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def engine(ckpt: Path, overlap: bool, blocks: int = 2000, **kw: Any) -> Engine:
    cfg = EngineConfig(
        dtype="float32",
        model=str(ckpt),
        block_size=BLOCK,
        kv_cache_gb=blocks * BLOCK_BYTES / 1024**3,
        async_scheduling=overlap,
        **kw,
    )
    return Engine.load(cfg)


def outcome(res: EngineResult) -> tuple[Any, ...]:
    """What a result says, less its timings."""
    return (res.request_id, res.token_ids, res.text, res.finish_reason, res.prompt_tokens,
            res.completion_tokens, res.cached_tokens, res.logprobs, res.label_scores)  # fmt: skip


def plain_requests(n: int, prefix: list[int]) -> list[EngineRequest]:
    """Plain requests of every kind the overlap takes: greedy and seeded sampling (top-k, top-p, min-p), stop
    strings and stop ids, ignore_eos, lengths from 1 token up, n > 1, prompts sharing a prefix."""
    reqs = []
    for i in range(n):
        p: dict[str, Any] = {"max_new_tokens": 1 + (i * 7) % 40, "seed": i}
        p["temperature"] = 0.0 if i % 3 == 0 else 0.9
        if i % 3 == 1:
            p.update(top_k=20, top_p=0.9, min_p=0.02)
        if i % 5 == 2:
            p["stop"] = ("e", "ab")
        if i % 7 == 3:
            p["stop_token_ids"] = (70 + i % 9,)
        if i % 4 == 0:
            p["ignore_eos"] = True
        if i % 11 == 5:
            p["n"] = 3
        ids = (prefix if i % 2 else []) + [3 + (i * 13) % 250 for _ in range(3 + i % 9)]
        reqs.append(EngineRequest(f"r{i}", GenerationParams(**p), prompt_token_ids=ids))
    return reqs


def run_both(ckpt: Path, reqs: list[EngineRequest], **kw: Any) -> tuple[list[Any], Engine]:
    """The requests' outcomes, serially and overlapped (which must agree); -> them, and the overlapped engine."""
    serial = [outcome(r) for r in engine(ckpt, False, **kw).generate(reqs)]
    overlapped = engine(ckpt, True, **kw)
    got = [outcome(r) for r in overlapped.generate([dataclasses.replace(r) for r in reqs])]
    assert got == serial
    return serial, overlapped


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_overlapped_steps_give_the_serial_tokens(ckpt: Path, prefix_cache: bool) -> None:
    """Plain requests, continuously batched through admissions, preemptions (a pool that runs out) and prompts
    that share cached blocks: the same results with the overlap, most decode steps of which it launched ahead."""
    reqs = plain_requests(40, prefix=[7] * 9)
    serial, eng = run_both(ckpt, reqs, blocks=48, max_num_seqs=12, prefix_cache=prefix_cache)
    stats = eng.stats()
    assert stats.overlapped_steps > 20 and stats.preemptions > 0
    assert not eng.has_work() and all(s.inflight == 0 for s in eng.scheduler.running)
    assert {o[3] for o in serial} >= {"length", "stop"}


def test_requests_that_are_not_plain_run_serially_beside_plain_ones(ckpt: Path) -> None:
    """Grammars, choices, logprobs, penalties and ranked samples take each token before the next step: while
    one runs, so does the batch, serially; the plain requests' results are the serial engine's either way."""
    plain = plain_requests(12, prefix=[])
    others = [
        GenerationParams(max_new_tokens=20, temperature=0.0, constraint=Constraint("regex", "[a-c]{3,9}")),
        GenerationParams(max_new_tokens=1, temperature=0.0, choices=("yes", "no", "maybe")),
        GenerationParams(max_new_tokens=12, temperature=0.7, seed=3, logprobs=True, top_logprobs=2),
        GenerationParams(max_new_tokens=12, temperature=0.0, repetition_penalty=1.3),
        GenerationParams(max_new_tokens=12, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5),
        GenerationParams(max_new_tokens=8, temperature=1.0, seed=5, n=2, best_of=3),
    ]
    reqs = plain + [EngineRequest(f"o{i}", p, prompt_token_ids=[5 + i] * 6) for i, p in enumerate(others)]
    run_both(ckpt, reqs, max_num_seqs=32)


def test_a_cancel_ends_with_the_tokens_of_the_steps_done(ckpt: Path) -> None:
    """A cancel while steps are in flight takes them first: the request ends with every token a serial engine
    would have given it by then, never one of a step it did not wait for, and the rest run on."""
    reqs = [
        EngineRequest(f"c{i}", GenerationParams(max_new_tokens=60, temperature=0.0, ignore_eos=True),
                      prompt_token_ids=[9 + i] * 5)
        for i in range(4)
    ]  # fmt: skip
    ended: dict[bool, list[Any]] = {}
    for overlap in (False, True):
        eng = engine(ckpt, overlap)
        for r in reqs:
            eng.add_request(dataclasses.replace(r))
        done: list[EngineResult] = []
        for _ in range(12):
            done += eng.step()
        eng.cancel("c1")
        while eng.has_work():
            done += eng.step()
        ended[overlap] = sorted(map(outcome, done))
        assert eng.stats().overlapped_steps > 0 if overlap else True
    assert ended[True] == ended[False]
    cancelled = next(o for o in ended[True] if o[0] == "c1")
    assert cancelled[3] == "cancelled" and 5 <= len(cancelled[1]) < 60


def test_a_failing_step_fails_its_requests_and_leaves_nothing_in_flight(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error on the device thread reaches the step that takes its tokens; abort_all then waits for what is
    in flight and fails every request, and the engine serves the next ones."""
    eng = engine(ckpt, True)
    reqs = plain_requests(6, prefix=[])
    for r in reqs:
        eng.add_request(dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=40, n=1)))
    while eng.stats().overlapped_steps == 0:
        eng.step()
    model = eng.model_runner.model

    def broken(*_: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(3):
            eng.step()
    failed = eng.abort_all(EngineError("internal", "device lost"))
    assert sorted(r.request_id for r in failed) == sorted(r.request_id for r in reqs)
    assert all(r.finish_reason == "error" for r in failed) and not eng.has_work()
    monkeypatch.undo()
    (again,) = eng.generate([reqs[0]])
    assert again.finish_reason in ("length", "eos", "stop", "repetition")
