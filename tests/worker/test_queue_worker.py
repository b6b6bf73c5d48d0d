"""The worker's queue loop in-process, on the engine stand-in (worker/queue/stand_in.py: every request answered at
once), against a real Redis that tests kill and restart: claims in bulk, leases, outages, exactly-once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from arq.constants import in_progress_key_prefix, job_key_prefix

from producer.client.batchq_client import BatchqClient
from producer.wire import keys, store
from producer.wire.jobs import Finished, claim_jobs, finish_jobs
from producer.wire.results import Result, Usage
from worker.config import STAND_IN_MODEL, WorkerConfig
from worker.embedded_redis import RedisServer
from worker.engine.async_engine import AsyncEngine
from worker.queue.job_handler import JobHandler
from worker.queue.loop import QueueWorker
from worker.queue.stand_in import InstantEngine
from worker.service import connect

QUEUE = keys.queue_name("default")


def config(url: str, **settings: object) -> WorkerConfig:
    return WorkerConfig(
        engine={"model": STAND_IN_MODEL, "max_num_seqs": 4}, engine_stand_in=True, redis_url=url,  # type: ignore[arg-type]
        poll_delay_s=0.01, **settings,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest_asyncio.fixture
async def stand_in() -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.load(config("redis://x").engine, loader=InstantEngine.load)  # type: ignore[arg-type]
    yield engine
    await engine.stop()


async def submit(url: str, n: int, tag: str = "") -> str:
    async with BatchqClient.from_url(url) as client:
        lines = [f'{{"id": "r{i}", "prompt": "{tag} item {i}", "max_new_tokens": 1}}' for i in range(n)]
        return (await client.submit_lines(lines)).batch_id


async def results(url: str, batch_id: str) -> list[Result]:
    async with BatchqClient.from_url(url) as client:
        return [r async for r in client.results(batch_id)]


async def test_a_worker_claims_in_bulk_and_writes_every_result_once(server: RedisServer, stand_in) -> None:
    cfg = config(server.url, burst=True)
    bid = await submit(server.url, 30)
    redis = connect(cfg)
    try:
        worker = QueueWorker(JobHandler(cfg, stand_in, redis), redis)
        await asyncio.wait_for(worker.main(), 30)  # burst: returns once the queue is empty
        got = await results(server.url, bid)
        assert sorted(r.index for r in got) == list(range(30))
        assert all(r.finish_reason == "eos" and r.model == STAND_IN_MODEL for r in got)
        st = await store.get_status(redis, bid)
        assert (st.completed, st.running, st.queued, st.state) == (30, 0, 0, "completed")
        assert await redis.zcard(QUEUE) == 0 and not await redis.keys("arq:*")  # every job key dequeued
    finally:
        await redis.aclose()


async def test_leased_jobs_leave_the_due_range_so_another_worker_claims_the_rest(server: RedisServer) -> None:
    """Jobs stay in the queue while they run. arq's poll read the head of the queue, which a busy worker
    held, so an added worker sat idle; a claim moves what it leases out of the due range instead."""
    bid = await submit(server.url, 10)
    redis = connect(config(server.url))
    try:
        first, _ = await claim_jobs(redis, QUEUE, 5, lease_s=60)
        second, _ = await claim_jobs(redis, QUEUE, 10, lease_s=60)
        ids = [j.job_id for j in first + second]
        assert sorted(ids) == sorted(keys.job_id(bid, i) for i in range(10)) and len(set(ids)) == 10
        assert await redis.exists(*(in_progress_key_prefix + i for i in ids)) == 10
        assert (await claim_jobs(redis, QUEUE, 10, lease_s=60))[0] == []
        assert [j.job_try for j in first + second] == [1] * 10
        assert (await store.get_status(redis, bid)).running == 10
    finally:
        await redis.aclose()


async def test_a_lapsed_lease_is_claimed_again_counted_as_a_try_and_written_once(server: RedisServer) -> None:
    """Worker A's lease lapses (it died, or stalled): B claims the job again, which counts a failed try.
    Whichever finishes first is stored; the other's result is refused and the counts stay exact."""
    bid = await submit(server.url, 1)
    redis = connect(config(server.url))
    try:
        (a,), _ = await claim_jobs(redis, QUEUE, 1, lease_s=0.05)
        await asyncio.sleep(0.1)
        (b,), _ = await claim_jobs(redis, QUEUE, 1, lease_s=60)
        assert (a.job_id, a.job_try, b.job_try) == (b.job_id, 1, 2)

        def ending(text: str) -> Finished:
            res = Result(id="r0", index=0, text=text, finish_reason="eos", usage=Usage.counted(3, 1))
            return Finished(a.job_id, bid, res)

        assert await finish_jobs(redis, QUEUE, [ending("from b")], ttl_s=60, cache_ttl_s=60) == [True]
        assert await finish_jobs(redis, QUEUE, [ending("from a")], ttl_s=60, cache_ttl_s=60) == [False]
        (only,) = await results(server.url, bid)
        st = await store.get_status(redis, bid)
        assert only.text == "from b" and (st.completed, st.running, st.queued) == (1, 0, 0)
        assert not await redis.exists(job_key_prefix + a.job_id)
    finally:
        await redis.aclose()


async def test_an_outage_while_claiming_and_writing_loses_nothing(
    server: RedisServer, stand_in, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis dies with results buffered and claims due: the loop backs off instead of ending, the buffered
    results wait, and once Redis is back every request ends with exactly one result."""
    cfg = config(server.url, lease_s=30.0)
    bid = await submit(server.url, 12, "outage")
    redis = connect(cfg)
    try:
        handler = JobHandler(cfg, stand_in, redis)
        worker = QueueWorker(handler, redis)
        jobs, _ = await claim_jobs(redis, QUEUE, 4, cfg.lease_s)
        await handler.take(jobs)
        while len(handler.buffer) < 4:  # the stand-in answers at its next step
            await asyncio.sleep(0.01)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="batchq.worker"):
            assert await worker.claim_once()  # must not raise
            flushing = asyncio.create_task(handler.flush())  # retries until Redis is back
            await asyncio.sleep(0.3)
            assert not flushing.done()
        assert "redis unavailable" in caplog.text
        server.start()
        await asyncio.wait_for(flushing, 30)
        cfg_burst = cfg.model_copy(update={"burst": True})
        handler.cfg = cfg_burst
        worker.cfg = cfg_burst
        await asyncio.wait_for(worker.main(), 30)
        got = await results(server.url, bid)
        assert sorted(r.index for r in got) == list(range(12))
        st = await store.get_status(redis, bid)
        assert (st.completed, st.running, st.queued) == (12, 0, 0)
    finally:
        await redis.aclose()


async def test_a_submits_requests_are_due_within_their_enqueue_millisecond(server: RedisServer) -> None:
    """Requests are scored at their submit's enqueue millisecond plus a fraction that orders them: a claim
    made in that very millisecond takes them all (a burst worker started at once must find the work)."""
    from producer.wire.jobs import _CLAIM

    await submit(server.url, 3)
    redis = connect(config(server.url))
    try:
        scores = [s for _, s in await redis.zrange(QUEUE, 0, -1, withscores=True)]
        ms = int(min(scores))
        assert len(scores) == 3 and all(ms <= s < ms + 1 for s in scores) and max(scores) > ms
        raw = await _CLAIM(redis, [QUEUE], [ms, 60_000, 10])
        assert (len(raw) - 1) // 4 == 3
        assert (await claim_jobs(redis, QUEUE, 10, lease_s=60))[0] == []  # leased: out of the due range
    finally:
        await redis.aclose()
