"""The arq job: a thin shell that hands one request to the engine and stores its result.

The model is loaded once at worker start-up (see service.py); a job only validates, looks up the
result cache, submits, awaits and writes. Every accepted request ends in exactly one stored result:
store.write_result's first write wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import orjson
from arq.constants import in_progress_key_prefix, retry_key_prefix
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.wire import keys, store
from producer.wire.contract import Request, Result, Timing
from worker.adapter import cancelled_result, engine_request, error_result, to_result
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.metrics import REDIS_ERRORS_SEEN, WorkerMetrics
from worker.result_cache import ResultCache, key_of

log = logging.getLogger("batchq.worker")

P = ParamSpec("P")
T = TypeVar("T")
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
Storer = Callable[..., Awaitable[None]]  # store_(result, generated=0)


async def retrying(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Call a Redis operation until it succeeds: a Redis blip must not lose an accepted result."""
    delay = 0.1
    while True:
        try:
            return await fn(*args, **kwargs)
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("request", retried=True)
            log.warning("redis unavailable (%s); retrying in %.1fs", type(e).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


MODEL_NOT_FOUND = "model_not_found"  # OpenAI's error code for a model it does not serve


def model_not_found(asked: str, cfg: WorkerConfig) -> str:
    served = cfg.engine.model
    return (
        f"request is for model {asked!r} but this worker serves {served!r} (queue {cfg.queue!r}); "
        f"name that model, or map the name with --model-alias {asked}={served}"
    )


@dataclass
class JobHandler:
    """Runs the jobs of one worker process; holds what they share."""

    cfg: WorkerConfig
    engine: AsyncEngine
    redis: Redis
    handing_back: bool = False  # set on SIGTERM once the grace period is over
    inflight: dict[str, str] = field(default_factory=dict)  # job id -> batch id
    reported: dict[str, int] = field(default_factory=dict)  # job id -> tokens added to its batch's counter
    completed: int = 0
    failed: int = 0
    from_cache: int = 0

    def __post_init__(self) -> None:
        self.result_cache = ResultCache(self.redis, self.engine.core.fingerprint, self.cfg.result_cache_ttl_s)
        self.metrics = WorkerMetrics(self.cfg, self.engine)  # served by service.py when metrics_port is set

    async def run(self, payload: Any, job_id: str, job_try: int) -> str:
        try:
            req = Request.model_validate(payload)
        except ValidationError as e:
            batch_id, index, attempt = keys.split_job_id(job_id)
            msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
            result = error_result(str(index + 1), index, "invalid_request", msg)
            await self._store(batch_id, result.model_copy(update={"attempt": attempt}))
            return "invalid"
        start = await retrying(store.start_attempt, self.redis, req.batch_id, req.index, req.attempt)
        if start == store.START_NOTHING:
            # Ran before (a lease expired while it finished elsewhere: first write won), or a retry has
            # superseded this attempt (its result would be refused).
            return "duplicate"
        store_ = self._storer(req, payload)
        if job_try > self.cfg.max_tries:
            msg = (
                f"request failed {self.cfg.max_tries} times: a worker died or was killed while running it "
                f"(max_tries={self.cfg.max_tries})"
            )
            await store_(error_result(req.id, req.index, "max_tries_exceeded", msg, req))
            return "max_tries"
        if req.model is not None and req.model != self.cfg.engine.model:
            await store_(
                error_result(req.id, req.index, MODEL_NOT_FOUND, model_not_found(req.model, self.cfg), req)
            )
            return MODEL_NOT_FOUND
        if start == store.START_CANCELLED:
            await store_(cancelled_result(req))
            return "cancelled"
        return await self._generate(req, job_id, store_)

    def _storer(self, req: Request, payload: Any) -> Storer:
        """Stores a result of this request's attempt, keeping the payload where a retry may need it."""
        raw = orjson.dumps(payload)

        async def store_(result: Result, generated: int = 0) -> None:
            result = result.model_copy(update={"attempt": req.attempt})
            await self._store(req.batch_id, result, raw, generated)

        return store_

    async def _generate(self, req: Request, job_id: str, store_: Storer) -> str:
        picked_at = time.time()
        try:
            ereq = engine_request(req, job_id)
        except ValueError as e:  # the contract admits what the engine refuses: a bug, reported per request
            await store_(error_result(req.id, req.index, "invalid_request", str(e), req))
            return "invalid"
        key = key_of(self.result_cache.fingerprint, req) if self.cfg.result_cache else None
        queued_s = max(0.0, picked_at - req.enqueued_at) if req.enqueued_at else None
        if key is not None and req.result_cache:
            answer = await retrying(self.result_cache.get, key)
            if answer is not None:
                timing = Timing(queued_s=queued_s, total_s=time.time() - picked_at)
                result = answer.result(
                    req.id, req.index, req.metadata, timing=timing, worker=self.cfg.worker_id
                )
                if result.model is None:  # stored before answers named their model: it is this queue's
                    result.model = self.cfg.engine.model
                await store_(result)
                self.from_cache += 1
                return answer.finish_reason
        self.inflight[job_id] = req.batch_id
        try:
            res = await self.engine.submit(ereq)
        except asyncio.CancelledError:
            # Shutdown or abort: stop computing it, and on a SIGTERM hand-back give the try back.
            self.engine.cancel(job_id)
            await asyncio.shield(self._hand_back(req, job_id))
            raise
        finally:
            self.inflight.pop(job_id, None)
            reported = self.reported.pop(job_id, 0)
        result = to_result(req, res, queued_s, self.cfg.worker_id, self.cfg.engine.model)
        await store_(result, res.completion_tokens - reported)
        if key is not None:
            try:
                await self.result_cache.put(key, result)
            except REDIS_ERRORS as e:  # the result is stored; only a later rerun loses the shortcut
                REDIS_ERRORS_SEEN.note("result_cache")
                log.warning("result cache not updated (%s)", type(e).__name__)
        return result.finish_reason

    async def _hand_back(self, req: Request, job_id: str) -> None:
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                if self.handing_back:
                    pipe.decr(retry_key_prefix + job_id)
                    pipe.delete(in_progress_key_prefix + job_id)  # another worker may take it at once
                pipe.srem(keys.batch_running(req.batch_id), str(req.index))
                await pipe.execute()
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("hand_back")
            log.warning("could not hand back %s (%s); its lease will expire", job_id, type(e).__name__)

    async def _store(
        self, batch_id: str, result: Result, request: bytes | None = None, generated: int = 0
    ) -> None:
        written = await retrying(self._write, batch_id, result, request, generated)
        if written:
            self.metrics.observe(result)
            if result.finish_reason == "error":
                self.failed += 1
            else:
                self.completed += 1

    async def _write(self, batch_id: str, result: Result, request: bytes | None, generated: int) -> bool:
        ttl = int(self.cfg.result_ttl_s)
        return await store.write_result(
            self.redis, batch_id, result, ttl_s=ttl, request=request, generated=generated
        )

    async def report_generated(self) -> None:
        """Add the tokens running requests generated since the last report to their batches' rate counters,
        so `producer top` and `wait` see a batch's rate while its requests run, not only as they end."""
        counts = self.engine.generated_tokens()
        by_batch: dict[str, int] = {}
        for job_id, batch_id in self.inflight.items():
            n = counts.get(job_id, 0) - self.reported.get(job_id, 0)
            if n > 0:
                by_batch[batch_id] = by_batch.get(batch_id, 0) + n
                self.reported[job_id] = counts[job_id]
        if by_batch:
            await store.add_generated(self.redis, by_batch)

    async def poll_cancellations(self) -> None:
        """Running requests of a cancelled batch stop at their next engine step."""
        batches = set(self.inflight.values())
        for batch_id in batches:
            if await store.is_cancelled(self.redis, batch_id):
                for job_id, b in list(self.inflight.items()):
                    if b == batch_id:
                        self.engine.cancel(job_id)
