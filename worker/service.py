"""One worker process: load the model once, bind to a queue, run the queue loop and its housekeeping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from producer.wire import keys
from producer.wire.redis_url import pool_from_url
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.queue import health
from worker.queue.job_handler import REDIS_ERRORS, JobHandler, retrying
from worker.queue.loop import QueueWorker
from worker.queue.metrics import REDIS_ERRORS_SEEN

log = logging.getLogger("batchq.worker")


class QueueBindingError(RuntimeError):
    pass


def connect(cfg: WorkerConfig) -> Redis:
    """The worker's client: redis://, rediss:// or redis+sentinel:// (it follows the master after a failover)."""
    pool = pool_from_url(
        cfg.redis_url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=3),
        retry_on_error=[ConnectionError, OSError],
        health_check_interval=10,
        socket_connect_timeout=5,
        socket_keepalive=True,
    )
    return Redis(connection_pool=pool)


async def bind_queue(redis: Redis, cfg: WorkerConfig) -> None:
    """A queue serves one model: the first live worker binds it; a worker for another model refuses to start."""
    key = keys.queue_model(keys.queue_name(cfg.queue))
    ttl = max(60, int(cfg.heartbeat_s * 6))
    model = cfg.engine.model
    await redis.set(key, model, nx=True, ex=ttl)
    bound = await redis.get(key)
    if bound is not None and bound.decode() != model:
        raise QueueBindingError(
            f"queue {cfg.queue!r} is served by workers of model {bound.decode()!r}; this worker serves "
            f"{model!r}. Use another --queue (one queue per model)."
        )
    await redis.expire(key, ttl)


async def publish_serving(handler: JobHandler) -> None:
    cfg = handler.cfg
    core = handler.engine.core
    markers = getattr(core, "reasoning", None)  # (the stand-in engine has none)
    await handler.result_cache.publish(
        keys.queue_name(cfg.queue),
        cfg.engine.model,
        core.max_model_len,
        cfg.result_cache,
        core.embedding_size,
        "none" if markers is None else markers.kind,
        handler.takes_images,
        cfg.image_urls,
    )


async def _every(period: float, fn: Callable[[], Awaitable[None]], what: str) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await fn()
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("housekeeping")
            log.debug("%s skipped: redis unavailable (%s)", what, type(e).__name__)
        except QueueBindingError:
            raise
        except Exception:
            log.exception("%s failed", what)


# The exit status of a worker whose engine cannot go on (a tensor-parallel rank died or hung).
EXIT_ENGINE_FAILED = 3


def _exit_for_reassignment(exc: BaseException) -> None:
    """The engine failed for good: exit now, writing nothing. The requests this worker leased are not
    answered with errors; their leases lapse and other workers run them, each exactly once."""
    log.critical("exiting (status %d) so that the leased requests run elsewhere: %s", EXIT_ENGINE_FAILED, exc)
    logging.shutdown()
    os._exit(EXIT_ENGINE_FAILED)


async def serve(cfg: WorkerConfig) -> int:
    t0 = time.monotonic()
    if cfg.engine_stand_in:
        from worker.queue.stand_in import InstantEngine

        aengine = await AsyncEngine.load(cfg.engine, loader=InstantEngine.load)  # type: ignore[arg-type]
    else:
        aengine = await AsyncEngine.load(cfg.engine)  # loads on the thread that will step it
    aengine.on_fatal = _exit_for_reassignment
    stats = aengine.core.stats()
    log.info(
        "model %s loaded in %.1fs; KV pool %d blocks of %d tokens; max_num_seqs=%d max_jobs=%d",
        cfg.engine.model,
        time.monotonic() - t0,
        stats.kv_blocks_total,
        cfg.engine.block_size,
        cfg.engine.max_num_seqs,
        cfg.max_jobs,
    )
    redis = connect(cfg)
    await retrying(bind_queue, redis, cfg)  # a worker started before Redis waits for it
    handler = JobHandler(cfg, aengine, redis)
    await retrying(publish_serving, handler)
    worker = QueueWorker(handler, redis)
    health.start_watchdog(aengine, cfg.stall_s)
    stats_log = health.StatsLogger(aengine)
    metrics_port = None
    liveness = health.Liveness(aengine, cfg.stall_s)
    if cfg.metrics_port is not None:
        metrics_port = handler.metrics.serve(cfg.metrics_port, liveness.report)
        log.info("Prometheus metrics on http://0.0.0.0:%d/metrics, health on /health", metrics_port)
    heartbeats = health.Heartbeats(cfg, aengine, metrics_port)

    async def log_stats() -> None:
        log.info(stats_log.line(handler.completed, handler.failed, handler.from_cache))

    async def heartbeat() -> None:
        await heartbeats.beat(redis)
        await bind_queue(redis, cfg)
        await publish_serving(handler)

    housekeeping = [
        asyncio.create_task(_every(0.5, handler.poll_cancellations, "cancel poll")),
        asyncio.create_task(_every(1.0, handler.report_generated, "progress report")),
        asyncio.create_task(_every(cfg.lease_s / 3, worker.renew_leases, "lease renewal")),
        asyncio.create_task(_every(cfg.heartbeat_s, heartbeat, "heartbeat")),
        asyncio.create_task(_every(cfg.log_interval_s, log_stats, "stats log")),
        asyncio.create_task(liveness.beat()),
    ]
    main = asyncio.create_task(worker.main())
    stopping: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        if stopping:
            return
        log.info(
            "%s: no new requests; finishing in-flight work (grace %.0fs)", sig.name, cfg.shutdown_grace_s
        )

        async def stop() -> None:
            await worker.drain(cfg.shutdown_grace_s)  # main() then writes what ended and returns

        stopping.append(asyncio.create_task(stop()))

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("worker %s serving queue %s", cfg.worker_id, keys.queue_name(cfg.queue))
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await main
    finally:
        if stopping:
            await stopping[0]
        for t in housekeeping:
            t.cancel()
        await asyncio.gather(*housekeeping, return_exceptions=True)
        log.info(stats_log.line(handler.completed, handler.failed, handler.from_cache))
        with contextlib.suppress(*REDIS_ERRORS):
            await redis.delete(keys.worker_heartbeat(cfg.worker_id))
            await redis.zrem(keys.WORKERS, cfg.worker_id)
        handler.metrics.close()
        await aengine.stop()
        await redis.aclose(close_connection_pool=True)
    log.info("worker %s stopped", cfg.worker_id)
    return 0
