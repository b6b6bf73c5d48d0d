"""A reasoning model through the whole queue path: `producer submit` with the reasoning fields (as batch
defaults and per line), a real worker on the tiny think model, and `producer results` in batchq JSONL and
OpenAI format carrying reasoning_content and reasoning_tokens, equal to the engine's own results; the result
cache answers them again whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.tiny_models import OPEN, THINK_ASK, build_think_checkpoint
from tests.worker.conftest import ROOT, Worker, assert_consistent, submit
from worker.embedded_redis import RedisServer
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig

pytestmark = pytest.mark.slow

LABELS = ["positive", "negative"]


def cli(url: str, *args: str) -> bytes:
    cmd = [sys.executable, "-m", "producer.cli", *args, "--redis-url", url]
    out = subprocess.run(cmd, capture_output=True, cwd=ROOT, check=False, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout


def results(url: str, bid: str, *args: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in cli(url, "results", bid, *args).splitlines()]


def test_submit_to_results_with_reasoning_fields(tmp_path: Path) -> None:
    model = build_think_checkpoint(tmp_path / "think")
    lines = [
        {"id": "think", "messages": THINK_ASK},
        {"id": "budget", "messages": THINK_ASK, "max_reasoning_tokens": 3, "choices": LABELS},
        {"custom_id": "off", "url": "/v1/chat/completions",
         "body": {"messages": THINK_ASK, "chat_template_kwargs": {"enable_thinking": False}}},
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    with RedisServer(appendonly=False) as server:
        worker = Worker(
            server.url, str(model), tmp_path, "think", "--dtype", "float32", "--kv-cache-gb", "0.02"
        )
        try:
            worker.wait_ready()
            flags = [
                "--max-new-tokens",
                "40",
                "--temperature",
                "0",
                "--chat-template-kwargs",
                orjson.dumps(OPEN).decode(),
            ]
            bid = submit(server.url, path, *flags)
            cli(server.url, "wait", bid, "--timeout", "120")
            mine = {r["id"]: r for r in results(server.url, bid)}
            openai = {r["custom_id"]: r for r in results(server.url, bid, "--format", "openai")}
            again = submit(server.url, path, *flags)  # the same requests: the result cache answers them
            cli(server.url, "wait", again, "--timeout", "120")
            cached = {r["id"]: r for r in results(server.url, again)}
            for b in (bid, again):  # the batch's counter sums its results' reasoning tokens (OpenAI's usage)
                assert_consistent(server.url, b, len(lines))
            status = cli(server.url, "status", bid).decode()
            api_usage, api_lines = openai_batch(server.url, str(model), tmp_path)
        finally:
            worker.stop()

    engine = Engine.load(EngineConfig(model=str(model), dtype="float32", kv_cache_gb=0.02))
    p = GenerationParams(max_new_tokens=40, temperature=0.0)
    want = engine.generate(
        [
            EngineRequest("think", p, messages=THINK_ASK, chat_template_kwargs=OPEN),
            EngineRequest(
                "budget",
                GenerationParams(
                    max_new_tokens=40, temperature=0.0, max_reasoning_tokens=3, choices=tuple(LABELS)
                ),
                messages=THINK_ASK,
                chat_template_kwargs=OPEN,
            ),
            EngineRequest(
                "off", p, messages=THINK_ASK, chat_template_kwargs={**OPEN, "enable_thinking": False}
            ),
        ]
    )
    for w in want:
        got = mine[w.request_id]
        assert (got["text"], got["reasoning_content"]) == (w.text, w.reasoning_content)
        assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": w.reasoning_tokens}
        body = openai[w.request_id]["response"]["body"]
        message = body["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == (w.text, w.reasoning_content)
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == w.reasoning_tokens
    for rid, got in cached.items():
        assert got["cached"] and {k: got[k] for k in ("text", "reasoning_content", "usage")} == {
            k: mine[rid][k] for k in ("text", "reasoning_content", "usage")
        }
    assert mine["think"]["reasoning_content"] and mine["off"]["reasoning_content"] == ""
    assert mine["budget"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    thinking = sum(r["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in mine.values())
    assert [s["label"] for s in mine["budget"]["label_scores"]] == LABELS
    assert thinking > 4 and f"(reasoning {thinking})" in status
    # OpenAI's Batch object sums its lines' reasoning tokens in usage.output_tokens_details
    per_line = [
        x["response"]["body"]["usage"]["completion_tokens_details"]["reasoning_tokens"] for x in api_lines
    ]
    assert per_line[0] > 0 and api_usage.output_tokens_details.reasoning_tokens == sum(per_line)
    assert api_usage.output_tokens == sum(
        x["response"]["body"]["usage"]["completion_tokens"] for x in api_lines
    )


def openai_batch(redis_url: str, model: str, tmp: Path) -> tuple[Any, list[dict[str, Any]]]:
    """A batch of two thinking chat lines through `producer serve` and the OpenAI client: (its usage, its
    output lines)."""
    from tests.producer.test_server import KEY_A, ApiServer, jsonl, output_lines, wait_done

    keys_file = tmp / "api-keys"
    keys_file.write_text(f"{KEY_A}\n")
    server = ApiServer(redis_url, keys_file, tmp, "think", "--model-alias", f"think={model}").start()
    try:
        server.wait_ready()
        body = {"model": "think", "messages": THINK_ASK, "max_tokens": 40, "temperature": 0,
                "chat_template_kwargs": OPEN}  # fmt: skip
        lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {**body, "max_reasoning_tokens": 2 + i}} for i in range(2)]  # fmt: skip
        with openai.OpenAI(base_url=server.url, api_key=KEY_A) as c:
            f = c.files.create(file=("think.jsonl", jsonl(lines)), purpose="batch")
            b = wait_done(
                c,
                c.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                ).id,
            )
            assert b.status == "completed" and b.usage is not None, b
            return b.usage, sorted(output_lines(c, b.output_file_id), key=lambda x: x["custom_id"])
    finally:
        server.kill()
