"""What `producer status` and `wait` say about a batch (issue 58): its state follows its counts through a
cancel and retries, and a submit that Redis cut short shows as partly enqueued, with what is in Redis and
the command that finishes it. Through the real console script against a real Redis; the worker's side is
its own store calls (store.write_result, as a worker writes results)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis as sync_redis
from arq.constants import job_key_prefix
from redis.asyncio import Redis

from producer.wire import keys, store
from producer.wire.results import Result, Usage
from worker.embedded_redis import RedisServer

PRODUCER = Path(sys.executable).with_name("producer")
pytestmark = pytest.mark.skipif(not PRODUCER.exists(), reason="run `pip install -e .` for the console script")


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": url}
    return subprocess.run(
        [str(PRODUCER), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def state(url: str, batch_id: str) -> tuple[str, int, int, int]:
    """(state, completed, cancelled, done) from `producer status --json`, checked against the text form."""
    s = orjson.loads(cli(url, "status", batch_id, "--json").stdout)
    assert f"batch      {batch_id}  ({s['state']}" in cli(url, "status", batch_id).stdout
    return s["state"], s["completed"], s["cancelled"], s["completed"] + s["failed"] + s["cancelled"]


async def answer(url: str, batch_id: str, endings: dict[int, str], attempt: int = 0) -> None:
    """A worker's results for requests `endings` (index -> finish reason) of their attempt `attempt`,
    keeping the request where the reason is one a retry can select, as a worker does."""
    redis = Redis.from_url(url)
    try:
        for index, reason in endings.items():
            job = await redis.get(job_key_prefix + keys.job_id(batch_id, index, attempt))
            request = orjson.dumps(orjson.loads(job)["a"][0]) if job else None
            result = Result(id=f"r{index}", index=index, text="x", finish_reason=reason, attempt=attempt,
                            usage=Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4))  # fmt: skip
            assert await store.write_result(redis, batch_id, result, request=request)
    finally:
        await redis.aclose()


def test_state_follows_the_counts_through_cancel_and_retries(redis_url: str, tmp_path: Path) -> None:
    """Issue 58: a batch showed (cancelled), then (completed) after `producer retry --timed-out` while it
    still held cancelled results. The state is derived from the counts (store.batch_state)."""
    url, bid = redis_url, "st1"
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "prompt": f"p{i}"}) + b"\n" for i in range(6)))
    assert cli(url, "submit", str(path), "--batch-id", bid).returncode == 0
    assert state(url, bid) == ("queued", 0, 0, 0)
    asyncio.run(answer(url, bid, {0: "eos", 1: "timeout", 2: "timeout"}))
    assert state(url, bid) == ("running", 3, 0, 3)
    out = cli(url, "cancel", bid)
    assert out.returncode == 0 and "3 queued requests cancelled" in out.stdout
    assert state(url, bid) == ("cancelled", 3, 3, 6)

    # The timed-out two again: running while they run, and still cancelled after: 3 results are cancelled.
    assert cli(url, "retry", bid, "--timed-out").returncode == 0
    assert state(url, bid) == ("running", 1, 3, 4)
    asyncio.run(answer(url, bid, {1: "eos", 2: "eos"}, attempt=1))
    assert state(url, bid) == ("cancelled", 3, 3, 6)
    wait = cli(url, "wait", bid)
    assert (
        wait.returncode == 4
        and f"batch {bid} cancelled: 3 completed, 0 failed, 3 cancelled of 6" in wait.stderr
    )
    listed = cli(url, "list").stdout.splitlines()
    assert any(line.split()[:2] == [bid, "cancelled"] for line in listed)

    # The cancelled three again: once they have answers, nothing cancelled is left, and it is completed.
    assert cli(url, "retry", bid, "--cancelled").returncode == 0
    assert state(url, bid) == ("running", 3, 0, 3)
    asyncio.run(answer(url, bid, {3: "eos", 4: "stop", 5: "eos"}, attempt=1))
    assert state(url, bid) == ("completed", 6, 0, 6)
    assert cli(url, "wait", bid).returncode == 0


def big_input(path: Path, n: int) -> Path:
    pad = "lorem ipsum " * 80  # ~1 KB a request: a few thousand fill a few MB of Redis
    path.write_bytes(
        b"".join(orjson.dumps({"id": f"r{i}", "prompt": f"{i} {pad}"}) + b"\n" for i in range(n))
    )
    return path


def test_a_submit_redis_cut_short_shows_as_partly_enqueued_with_the_command_that_finishes_it(
    redis_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """Issue 58: `producer status` said "queued 50000" while Redis (at maxmemory) held 26,000 of them."""
    server = redis_server_factory(appendonly=False)
    url, bid, n = server.url, "nightly-partial", 8000
    path = big_input(tmp_path / "in.jsonl", n)
    r = sync_redis.Redis.from_url(url)
    try:
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", used + 4 * 1024 * 1024)  # room for some of the ~9 MB of jobs, not all
        cut = cli(url, "submit", str(path), "--batch-id", bid)
        assert cut.returncode == 1 and "maxmemory" in cut.stderr, cut.stderr
        in_queue = r.zcard(keys.DEFAULT_QUEUE)
        assert 0 < in_queue < n

        s = orjson.loads(cli(url, "status", bid, "--json").stdout)
        resume = f"producer submit FILE --batch-id {bid}"
        assert (s["total"], s["enqueued"], s["partly_enqueued"], s["resume"]) == (n, in_queue, True, resume)
        text = cli(url, "status", bid).stdout
        assert f"batch      {bid}  (queued, partly enqueued)" in text
        assert (
            f"total {n}  enqueued {in_queue}  queued {in_queue}  running 0  not enqueued {n - in_queue}"
            in text
        )
        assert f"{in_queue} of {n} requests are in Redis" in text and resume in text
        waited = cli(url, "wait", bid, "--timeout", "1")
        assert waited.returncode == 3 and f"is partly enqueued: {in_queue} of {n}" in waited.stderr

        # The resume command, once Redis has room: the rest goes in, nothing twice, and it is whole.
        r.config_set("maxmemory", 0)
        again = cli(url, "submit", str(path), "--batch-id", bid)
        assert again.returncode == 0 and f"{n - in_queue} enqueued now" in again.stderr, again.stderr
        assert r.zcard(keys.DEFAULT_QUEUE) == n
        s = orjson.loads(cli(url, "status", bid, "--json").stdout)
        assert (s["enqueued"], s["partly_enqueued"], s["resume"], s["queued"]) == (None, False, None, n)
        text = cli(url, "status", bid).stdout
        assert f"batch      {bid}  (queued)" in text and f"total {n}  queued {n}  running 0\n" in text
    finally:
        r.close()
