"""`producer retry` against a real worker process: new attempts replace old results, the counts add up to
the total at every moment (each request by its current attempt), concurrent retries enqueue nothing twice,
a superseded attempt cannot write.

The worker is held with SIGSTOP while the batch is submitted and cancelled, so that every request is
cancelled while still queued (deterministic), and while retries are claimed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import orjson
import pytest

from producer.client.batchq_client import BatchqClient
from producer.wire import store
from producer.wire.results import Result
from tests.worker.conftest import ROOT, assert_consistent

pytestmark = pytest.mark.slow

LINES = [
    {"id": "huge", "prompt": "word " * 3000, "max_new_tokens": 4},  # longer than the model: always fails
    *({"id": f"r{i}", "prompt": f"retry me {i}", "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
      for i in range(4)),
    {"id": "slow", "prompt": "a slow one", "max_new_tokens": 800, "temperature": 0, "ignore_eos": True,
     "timeout_s": 0.05},  # always cut by its timeout
]  # fmt: skip


def cli(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "producer.cli", *args, "--redis-url", url]
    out = subprocess.run(cmd, capture_output=True, cwd=ROOT, check=False, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return out


async def test_retry_replaces_what_failed_and_leaves_what_succeeded(shared_worker) -> None:
    server, worker = shared_worker
    url = server.url
    async with BatchqClient.from_url(url) as c:
        worker.signal(signal.SIGSTOP)
        try:
            bid = (await c.submit_lines([orjson.dumps(x) for x in LINES])).batch_id
            assert await c.cancel(bid) == len(LINES)
            assert (await c.status(bid)).state == "cancelled"
            # Two retries at once: each request is claimed, and enqueued, by exactly one of them.
            a, b = await asyncio.gather(c.retry(bid, cancelled=True), c.retry(bid, cancelled=True))
            assert a.enqueued + b.enqueued == len(LINES) and a.in_flight + b.in_flight == len(LINES)
            again = await c.retry(bid)
            assert (again.enqueued, again.in_flight) == (0, len(LINES))
            st = await c.status(bid)  # each request counted by its new attempt: queued again
            assert (st.state, st.retrying, st.queued, st.cancelled, st.done, st.finished_at) == (
                "running", len(LINES), len(LINES), 0, 0, None
            )  # fmt: skip
            assert st.queued + st.running + st.completed + st.failed + st.cancelled == st.total
            assert [r async for r in c.results(bid)] == []  # the superseded results are not counted
            # A late result of the superseded attempt 0 is refused and changes nothing.
            late = Result(id="r0", index=1, finish_reason="length")
            assert not await store.write_result(c.redis, bid, late)
            assert (await c.status(bid)).model_dump() == st.model_dump()
        finally:
            worker.signal(signal.SIGCONT)

        st = await c.wait(bid, timeout=60)
        first = assert_consistent(url, bid, len(LINES))
        assert (st.state, st.completed, st.failed, st.cancelled, st.retrying) == ("completed", 5, 1, 0, 0)
        assert {r["attempt"] for r in first.values()} == {1}
        assert first[0]["error"]["type"] == "prompt_too_long" and first[5]["finish_reason"] == "timeout"
        assert all(first[i]["finish_reason"] == "length" for i in range(1, 5))

        # The CLI: the failed and the timed-out request again; the four answers are untouched.
        report = orjson.loads(cli(url, "retry", bid, "--failed", "--timed-out", "--json").stdout)
        assert (report["selected"], report["enqueued"]) == (2, 2)
        await c.wait(bid, timeout=60)
        second = assert_consistent(url, bid, len(LINES))
        assert second[0]["attempt"] == 2 and second[5]["attempt"] == 2
        assert second[0]["timing"] != first[0]["timing"]  # a new result, of the new attempt
        assert all(second[i] == first[i] for i in range(1, 5))

    ids = [x["id"] for x in LINES]
    every = [orjson.loads(x) for x in cli(url, "results", bid).stdout.splitlines()]
    assert [r["id"] for r in every] == ids  # input order and identity across retries
    failed = [orjson.loads(x) for x in cli(url, "results", bid, "--only", "failed").stdout.splitlines()]
    assert [r["id"] for r in failed] == ["huge"] and failed[0]["attempt"] == 2
    done = [orjson.loads(x) for x in cli(url, "results", bid, "--only", "completed").stdout.splitlines()]
    assert [r["id"] for r in done] == ids[1:]
    assert cli(url, "results", bid, "--only", "cancelled").stdout == b""
