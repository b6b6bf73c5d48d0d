"""QueueWorker's own handling of a Redis outage, driven in-process against a real Redis that is killed."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from arq.constants import in_progress_key_prefix
from redis.asyncio.client import Pipeline

from producer.client.batchq_client import BatchqClient
from producer.wire import keys
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.jobs import JobHandler
from worker.queue_worker import QueueWorker
from worker.service import connect


def tiny_engine(model_dir: Path, **settings: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **settings)


async def test_job_whose_opening_read_meets_an_outage_is_left_to_its_lease(
    server, tiny_model_dir, caplog: pytest.LogCaptureFixture
) -> None:
    """arq starts a job task after a poll; when Redis dies before the task's first read, the task must
    end quietly (the job stays queued, its lease lapses) instead of dying with an exception that asyncio
    reports as never retrieved. test_faults' Redis-restart test hits this window only by chance; here it
    is forced."""
    cfg = WorkerConfig(engine=tiny_engine(tiny_model_dir), redis_url=server.url)
    aengine = await AsyncEngine.load(cfg.engine)
    redis = connect(cfg)
    try:
        handler = JobHandler(cfg, aengine, redis)
        worker = QueueWorker(handler, redis_pool=redis)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="batchq.worker"):
            await worker.run_job(keys.job_id("b-outage", 0), 0)  # must not raise
        assert "not started: redis unavailable (ConnectionError)" in caplog.text
    finally:
        await aengine.stop()
        await redis.aclose()


@pytest.mark.parametrize("when", ["before WATCH", "after WATCH"])
async def test_outage_while_leasing_a_job_neither_ends_the_worker_nor_leaks_its_slot(
    server, tiny_model_dir, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """Redis dies after a poll found a job and before its lease is taken. redis-py reports a connection
    lost under WATCH as a WatchError, which arq's start_jobs let escape (ending the worker's main loop),
    and arq kept the job slot it had counted. The poll must back off like any outage, give the slot back,
    and run the job once Redis is back."""
    cfg = WorkerConfig(engine=tiny_engine(tiny_model_dir, max_num_seqs=1), redis_url=server.url)
    aengine = await AsyncEngine.load(cfg.engine)
    redis = connect(cfg)
    try:
        async with BatchqClient.from_url(server.url) as client:
            line = '{"id": "a", "prompt": "hello", "max_new_tokens": 3, "temperature": 0}'
            report = await client.submit_lines([line], queue=cfg.queue)
        handler = JobHandler(cfg, aengine, redis)
        worker = QueueWorker(handler, redis_pool=redis)
        pipeline = redis.pipeline

        def kill_first_transaction(transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
            pipe = pipeline(transaction, shard_hint)
            if transaction:  # the lease's WATCH/MULTI: Redis goes down just before or after WATCH
                redis.pipeline = pipeline  # type: ignore[method-assign]
                if when == "before WATCH":
                    server.kill()
                else:
                    watch = pipe.watch

                    async def watch_then_kill(*names: str) -> bool:
                        ok = await watch(*names)
                        server.kill()
                        return ok

                    pipe.watch = watch_then_kill  # type: ignore[method-assign]
            return pipe

        redis.pipeline = kill_first_transaction  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="batchq.worker"):
            await worker._poll_iteration()  # must not raise
        assert "redis unavailable" in caplog.text
        assert worker.job_counter == 0 and not worker.tasks
        server.start()
        await worker._poll_iteration()
        assert list(worker.tasks) == [keys.job_id(report.batch_id, 0)]
        await asyncio.gather(*worker.tasks.values())
        assert worker.job_counter == 0
        async with BatchqClient.from_url(server.url) as client:
            results = [r async for r in client.results(report.batch_id)]
        assert [(r.id, r.finish_reason, r.usage.completion_tokens) for r in results] == [("a", "length", 3)]
    finally:
        await aengine.stop()
        await redis.aclose()


async def test_a_worker_reads_past_the_jobs_other_workers_hold(server, tiny_model_dir) -> None:
    """Jobs stay queued while they run, so the head of the queue is what the first worker leased. A second
    worker that read only one page (max_jobs ids) saw nothing but leased jobs and sat idle while the rest
    of the batch waited: it must read on to the free ones."""
    cfg = WorkerConfig(
        engine=tiny_engine(tiny_model_dir, max_num_seqs=2), redis_url=server.url, prefetch=0, lease_s=60.0
    )
    aengine = await AsyncEngine.load(cfg.engine)
    redis = connect(cfg)
    try:
        async with BatchqClient.from_url(server.url) as client:
            lines = [f'{{"prompt": "item {i}", "max_new_tokens": 2, "temperature": 0}}' for i in range(10)]
            await client.submit_lines(lines, queue=cfg.queue)
        queued = [jid.decode() for jid in await redis.zrange(keys.queue_name(cfg.queue), 0, -1)]
        for jid in queued[:5]:  # another worker runs the first five
            await redis.psetex(in_progress_key_prefix + jid, 60_000, b"1")
        worker = QueueWorker(JobHandler(cfg, aengine, redis), redis_pool=redis)
        assert worker.queue_read_limit == cfg.max_jobs == 2
        await worker._poll_iteration()
        assert sorted(worker.tasks) == sorted(queued[5:7])
        await asyncio.gather(*worker.tasks.values())
    finally:
        await aengine.stop()
        await redis.aclose()
