"""Submit's warning that the model serving a queue ignores the reasoning fields a batch sets (issue 58, item 8):
once per batch, only when a live worker's model is known to have no reasoning markers."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import orjson
from redis.asyncio import Redis

from producer.client.submit import submit_stream
from producer.wire import keys
from producer.wire.request_params import SamplingParams
from producer.wire.workers import Heartbeat, QueueServing

ROOT = Path(__file__).resolve().parents[2]
ASK = [{"role": "user", "content": "Is the food good?"}]
LINES = [
    {"id": "budget", "messages": ASK, "max_reasoning_tokens": 8},
    {"id": "effort", "messages": ASK, "reasoning_effort": "low"},
    {"id": "both", "messages": ASK, "max_reasoning_tokens": 0, "reasoning_effort": "high"},
    {"id": "plain", "messages": ASK},
    {"id": "raw", "prompt": "no chat, no reasoning"},
    {
        "custom_id": "other",
        "url": "/v1/chat/completions",  # another model's: fails at the worker, by name
        "body": {"model": "another-model", "messages": ASK, "max_reasoning_tokens": 8},
    },
]
DATA = b"".join(orjson.dumps(x) + b"\n" for x in LINES)
WARNING = (
    "warning: 3 requests set max_reasoning_tokens/reasoning_effort, but the model serving queue 'q' "
    "(smollm2-135m) has no reasoning markers: they are ignored"
)


async def serve(redis: Redis, reasoning: str | None, live: bool = True) -> None:
    """What a worker of queue q publishes (worker/service.py publish_serving), and its heartbeat."""
    serving = QueueServing(
        model="smollm2-135m", fingerprint="ab" * 32, max_model_len=8192, reasoning=reasoning
    )
    await redis.set(keys.queue_serving(keys.queue_name("q")), serving.model_dump_json())
    await redis.delete(keys.worker_heartbeat("w1"))
    if live:
        hb = Heartbeat(
            worker_id="w1", host="h", queue=keys.queue_name("q"), model="smollm2-135m", ts=time.time(),
            running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=1, tokens_generated=0, progress_age_s=0.0,
            stall_s=60.0,
        )  # fmt: skip
        await redis.set(keys.worker_heartbeat("w1"), hb.model_dump_json(), ex=30)
        await redis.zadd(keys.WORKERS, {"w1": hb.ts})


async def warnings(redis: Redis, bid: str, data: bytes = DATA, **kw: object) -> list[str]:
    report = await submit_stream(redis, io.BytesIO(data), batch_id=bid, queue="q", **kw)  # type: ignore[arg-type]
    return report.warnings


async def test_reasoning_fields_for_a_model_without_markers_are_warned_of_once_per_batch(
    redis: Redis,
) -> None:
    await serve(redis, "none")
    assert await warnings(redis, "b1") == [WARNING]
    one = orjson.dumps({"messages": ASK}) + b"\n"
    # as a batch default, every chat line carries it
    got = await warnings(redis, "b2", one * 5, defaults=SamplingParams(reasoning_effort="low"))
    assert got == [WARNING.replace("3 requests set", "5 requests set")]
    assert await warnings(redis, "b3", one) == []


async def test_no_warning_without_knowledge_or_for_a_reasoning_model(redis: Redis) -> None:
    await serve(redis, "none", live=False)  # no live worker: what serves the queue now is not known
    assert await warnings(redis, "dead") == []
    await serve(redis, None)  # a worker that does not say whether its model reasons
    assert await warnings(redis, "older") == []
    await serve(redis, "think")
    assert await warnings(redis, "think") == []
    await serve(redis, "harmony")
    assert await warnings(redis, "harmony") == []


async def test_producer_submit_prints_the_warning_on_stderr(
    redis: Redis, redis_url: str, tmp_path: Path
) -> None:
    await serve(redis, "none")
    path = tmp_path / "in.jsonl"
    path.write_bytes(DATA)
    cmd = [sys.executable, "-m", "producer.cli", "submit", str(path), "--queue=q", f"--redis-url={redis_url}"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines().count(WARNING) == 1
