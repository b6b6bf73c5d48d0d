"""A fleet: eight worker processes (on the engine stand-in, so the queue path is all there is) against one
Redis, several batches, two workers killed with SIGKILL mid-run: every request ends in exactly one result,
every worker took a share, and the counts add up. benchmarks/queue_bench.py measures the same at scale."""

from __future__ import annotations

import signal
import time

import orjson
import pytest
import redis

from producer.wire import keys
from tests.worker.conftest import assert_consistent, results_count, submit, wait_until, write_jsonl

pytestmark = pytest.mark.slow

WORKERS, BATCHES, PER_BATCH = 8, 3, 1500


def test_eight_workers_lose_nothing_and_double_nothing_when_two_are_killed(server, workers, tmp_path) -> None:
    args = ["--engine-stand-in", "--max-num-seqs", "32", "--lease-s", "2", "--poll-delay-s", "0.02"]
    fleet = [workers(server.url, "stand-in", *args, name=f"f{i}") for i in range(WORKERS)]
    for w in fleet:
        w.wait_ready()
    bids = []
    for b in range(BATCHES):
        lines = [
            {"id": f"b{b}-{i}", "prompt": f"batch {b} item {i}", "max_new_tokens": 1}
            for i in range(PER_BATCH)
        ]
        bids.append(submit(server.url, write_jsonl(tmp_path / f"in{b}.jsonl", lines)))
    total = BATCHES * PER_BATCH

    def stored() -> int:
        return sum(results_count(server.url, b) for b in bids)

    wait_until(lambda: stored() >= total // 3, 120, "a third of the results")
    for w in fleet[:2]:
        w.signal(signal.SIGKILL)
        w.wait(10)
    killed_at = time.monotonic()
    wait_until(lambda: stored() == total, 180, "every result")
    shares: dict[str, int] = {}
    for bid in bids:
        for r in assert_consistent(server.url, bid, PER_BATCH).values():
            assert r["finish_reason"] == "eos" and r["model"] == "stand-in"
            shares[r["worker"]] = shares.get(r["worker"], 0) + 1
    assert sum(shares.values()) == total
    assert len(shares) >= WORKERS - 2, shares  # the survivors all took work (the killed ones may have too)
    assert time.monotonic() - killed_at < 180
    r = redis.Redis.from_url(server.url)
    try:
        assert r.zcard(keys.queue_name("default")) == 0  # nothing left queued, nothing dequeued twice
        for bid in bids:
            meta = {k.decode(): v.decode() for k, v in r.hgetall(keys.batch_meta(bid)).items()}
            assert int(meta["completed"]) == PER_BATCH and meta.get("finished_at")
            assert r.scard(keys.batch_running(bid)) == 0
            ids = [orjson.loads(v)["id"] for v in r.hgetall(keys.batch_results(bid)).values()]
            assert len(ids) == len(set(ids)) == PER_BATCH
    finally:
        r.close()
    for w in fleet[2:]:
        assert w.proc.poll() is None, w.log()
