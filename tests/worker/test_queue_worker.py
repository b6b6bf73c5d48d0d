"""QueueWorker's own handling of a Redis outage, driven in-process against a real Redis that is killed."""

from __future__ import annotations

import logging

import pytest

from producer import keys
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.jobs import JobRunner
from worker.queue_worker import QueueWorker
from worker.service import connect, engine_config


async def test_job_whose_opening_read_meets_an_outage_is_left_to_its_lease(
    server, tiny_model_dir, caplog: pytest.LogCaptureFixture
) -> None:
    """arq starts a job task after a poll; when Redis dies before the task's first read, the task must
    end quietly (the job stays queued, its lease lapses) instead of dying with an exception that asyncio
    reports as never retrieved. test_faults' Redis-restart test hits this window only by chance; here it
    is forced."""
    cfg = WorkerConfig(model=str(tiny_model_dir), redis_url=server.url, device="cpu", dtype="float32")
    aengine = await AsyncEngine.load(engine_config(cfg))
    redis = connect(cfg)
    try:
        runner = JobRunner(cfg, aengine, redis, frozenset({cfg.model}))
        worker = QueueWorker(runner, redis_pool=redis)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="batchq.worker"):
            await worker.run_job(keys.job_id("b-outage", 0), 0)  # must not raise
        assert "not started: redis unavailable (ConnectionError)" in caplog.text
    finally:
        await aengine.stop()
        await redis.aclose()
