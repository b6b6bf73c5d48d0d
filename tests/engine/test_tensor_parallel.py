"""Tensor parallelism through the engine library, with real rank processes over gloo: a model split over two
ranks answers as the unsplit model does (greedy tokens equal, logprobs and label scores within 1e-5; the
row-parallel sums add in another order), KV heads replicated where there are fewer than ranks, refusals by
name, and the group's faults: a rank that dies or hangs takes the engine down within seconds, and no rank
process outlives its engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine.tensor_parallel import ShardedModel
from worker.engine_config import EngineConfig
from worker.models.errors import ModelLoadError
from worker.parallel.group import GroupFailure

pytestmark = pytest.mark.slow

PROMPTS = ["hello there", "the quick brown fox jumps over", "a", "once upon a time, in a land far away"]
LABELS = ("yes", "no", "maybe")


def requests() -> list[EngineRequest]:
    greedy = GenerationParams(max_new_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2)
    out = [EngineRequest(f"g{i}", greedy, prompt=p) for i, p in enumerate(PROMPTS)]
    # temperature 0: the label of highest score (at the default temperature a label is drawn, seed unset)
    label = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)
    out.append(EngineRequest("label", label, prompt=PROMPTS[1]))
    # n = 2: its second sample forks from the first's prompt blocks (the block copy runs on every rank)
    two = GenerationParams(max_new_tokens=6, temperature=0.0, n=2)
    out.append(EngineRequest("two", two, prompt="seventeen bytes!!"))
    return out


def engine(path: Path, tp: int, **settings: object) -> Engine:
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", tensor_parallel_size=tp,
                       kv_cache_gb=0.02, **settings)  # type: ignore[arg-type]  # fmt: skip
    return Engine.load(cfg)


def answers(path: Path, tp: int) -> list[EngineResult]:
    e = engine(path, tp)
    try:
        return e.generate(requests())
    finally:
        e.close()


def assert_same_answers(one: list[EngineResult], split: list[EngineResult]) -> None:
    for a, b in zip(one, split, strict=True):
        assert b.error is None, b.error
        assert b.token_ids == a.token_ids and b.text == a.text, a.request_id
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-5, a.request_id
            assert [c.token for c in x.top] == [c.token for c in y.top]
        for x, y in zip(a.label_scores or [], b.label_scores or [], strict=True):
            assert x.label == y.label and abs(x.logprob - y.logprob) < 1e-5
        assert [s.token_ids for s in a.samples or []] == [s.token_ids for s in b.samples or []]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3", "mixtral", "gpt_oss"])
def test_a_model_split_over_two_ranks_answers_as_the_whole_model_does(tmp_path: Path, arch: str) -> None:
    # phi3's checkpoint fuses q/k/v and gate/up (each rank takes its rows of each part); gemma2 soft-caps and
    # slides; mixtral and gpt-oss split every expert (gpt-oss: biases, sinks, its fused expert tensors)
    path = build_tiny_checkpoint(tmp_path / arch, arch)
    assert_same_answers(answers(path, 1), answers(path, 2))


def test_four_ranks_over_two_kv_heads_replicate_them(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "llama", "llama")  # 4 query heads, 2 KV heads
    e = engine(path, 4)
    try:
        model = e.model_runner.model
        assert isinstance(model, ShardedModel) and model.spec.num_kv_heads == 1 and model.spec.num_heads == 1
        split = e.generate(requests())
    finally:
        e.close()
    assert_same_answers(answers(path, 1), split)


def test_what_does_not_split_is_refused_by_name(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(
        ModelLoadError, match=r"tensor_parallel_size 3: the model's 4 attention heads do not divide"
    ):
        engine(path, 3)
    olmo = build_tiny_checkpoint(tmp_path / "olmo2", "olmo2")
    with pytest.raises(ModelLoadError, match=r"OLMo 2's norms over whole q / k projections"):
        engine(olmo, 2)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return out.returncode == 0 and not out.stdout.strip().startswith("Z")


@pytest.fixture
def split_engine(tmp_path: Path) -> Iterator[Engine]:
    e = engine(build_tiny_checkpoint(tmp_path / "llama", "llama"), 2, collective_timeout_s=3.0)
    yield e
    e.close()


def rank_pid(e: Engine) -> int:
    model = e.model_runner.model
    assert isinstance(model, ShardedModel)
    return int(model.procs[0].pid)


def test_a_rank_that_dies_takes_the_engine_down_at_once(split_engine: Engine) -> None:
    os.kill(rank_pid(split_engine), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(GroupFailure, match="tensor-parallel rank 0"):
        split_engine.generate(requests())
    assert time.monotonic() - t0 < 5


def test_a_rank_that_dies_while_the_engine_idles_is_seen_within_a_second(split_engine: Engine) -> None:
    assert split_engine.failure() is None
    os.kill(rank_pid(split_engine), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while split_engine.failure() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert split_engine.failure() is not None and "exited with status -9" in str(split_engine.failure())


def test_a_rank_that_hangs_takes_the_engine_down_after_the_collective_timeout(split_engine: Engine) -> None:
    pid = rank_pid(split_engine)
    os.kill(pid, signal.SIGSTOP)  # alive, but never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(GroupFailure):
            split_engine.generate(requests())
        assert time.monotonic() - t0 < 3.0 + 10  # the 3 s timeout, and the slack of a loaded machine
    finally:
        os.kill(pid, signal.SIGKILL)


def test_closing_the_engine_ends_its_ranks(split_engine: Engine) -> None:
    pid = rank_pid(split_engine)
    split_engine.generate(requests()[:1])
    split_engine.close()
    assert not alive(pid)


_KILLED = """
import sys
from worker.engine.engine import Engine
from worker.engine_config import EngineConfig
e = Engine.load(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, kv_cache_gb=0.02))
print(e.model_runner.model.procs[0].pid, flush=True)
sys.stdin.read()
"""


def test_no_rank_outlives_an_engine_process_killed_outright(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "llama", "llama")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])  # fmt: skip
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    assert alive(pid)
    proc.kill()  # SIGKILL: no handler, no atexit
    proc.wait(30)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
