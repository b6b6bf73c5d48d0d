"""Reasoning fields on a model without reasoning markers are said to be ignored, never dropped silently
(issue 58, item 8): each such chat request's result carries a `warnings` entry naming them (worker/queue/adapter.py),
the worker publishes that its model has no markers (QueueServing.reasoning), and `producer submit` warns
once per batch while a live worker says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from producer.wire import keys
from producer.wire.request_params import Request
from producer.wire.workers import QueueServing
from tests.tiny_models import build_think_checkpoint
from tests.worker.conftest import ROOT, results_count, wait_until, write_jsonl
from worker.engine.engine import Engine
from worker.engine_config import EngineConfig
from worker.queue.adapter import engine_request, to_result

ASK = [{"role": "user", "content": "Is the food good?"}]
LINES: dict[str, dict[str, Any]] = {
    "budget": {"messages": ASK, "max_reasoning_tokens": 2},
    "effort": {"messages": ASK, "reasoning_effort": "low"},
    "both": {
        "messages": ASK,
        "max_reasoning_tokens": 2,
        "reasoning_effort": "high",
        "choices": ["yes", "no"],
    },
    "plain": {"messages": ASK},
}
IGNORED = {
    "budget": ["max_reasoning_tokens ignored: the model has no reasoning markers"],
    "effort": ["reasoning_effort ignored: the model has no reasoning markers"],
    "both": ["max_reasoning_tokens and reasoning_effort ignored: the model has no reasoning markers"],
    "plain": None,
}


def request(rid: str, line: dict[str, Any]) -> Request:
    params = {"max_new_tokens": 6, "temperature": 0.0, **{k: v for k, v in line.items() if k != "messages"}}
    return Request.model_validate({"batch_id": "b", "id": rid, "index": 0, "messages": line["messages"],
                                   "params": params})  # fmt: skip


def test_a_result_names_the_reasoning_fields_a_model_without_markers_ignored(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = Engine.load(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_gb=0.02))
    think = Engine.load(
        EngineConfig(model=str(build_think_checkpoint(tmp_path / "think")), dtype="float32", kv_cache_gb=0.02)
    )
    assert plain.reasoning is None and think.reasoning is not None
    for engine, want in ((plain, IGNORED), (think, dict.fromkeys(IGNORED))):
        reqs = {rid: request(rid, line) for rid, line in LINES.items()}
        done = engine.generate([engine_request(r, rid) for rid, r in reqs.items()])
        for (rid, req), res in zip(reqs.items(), done, strict=True):
            result = to_result(req, res, None, "w", "m")
            assert result.error is None and result.warnings == want[rid], (rid, engine.reasoning)
            line = orjson.loads(result.to_user_json())
            assert line.get("warnings") == want[rid]  # absent where there is nothing to say


def cli(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args, "--redis-url", url],
                          capture_output=True, cwd=ROOT, check=False, timeout=120)  # fmt: skip


@pytest.mark.slow
def test_a_worker_says_its_model_has_no_markers_and_submit_and_results_pass_it_on(
    shared_worker: Any, tmp_path: Path
) -> None:
    server, worker = shared_worker
    r = redis.Redis.from_url(server.url)
    try:
        raw = r.get(keys.queue_serving(keys.queue_name(None)))
    finally:
        r.close()
    assert raw is not None and QueueServing.model_validate_json(raw).reasoning == "none"
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": rid, **line} for rid, line in LINES.items()])
    out = cli(server.url, "submit", str(path), "--json", "--max-new-tokens", "6")
    assert out.returncode == 0, out.stderr.decode()
    warning = (
        "warning: 3 requests set max_reasoning_tokens/reasoning_effort, but the model serving queue 'default' "
        f"({worker.model}) has no reasoning markers: they are ignored"
    )
    assert out.stderr.decode().splitlines().count(warning) == 1
    bid = orjson.loads(out.stdout)["batch_id"]
    wait_until(lambda: results_count(server.url, bid) == len(LINES), 120, "the batch's results")
    got = cli(server.url, "results", bid)
    assert got.returncode == 0, got.stderr.decode()
    results = {x["id"]: x for x in map(orjson.loads, got.stdout.splitlines())}
    assert {rid: x.get("warnings") for rid, x in results.items()} == IGNORED
