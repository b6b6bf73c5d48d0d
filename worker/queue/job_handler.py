"""What a worker does with the jobs it claimed: each becomes an engine request or, at once, a result.

The model is loaded once at worker start-up (see service.py). A claimed job (producer/wire/jobs.py) is
validated, refused when it used up max_tries or names another model, answered as cancelled when its batch
was, looked up in the result cache, or handed to the engine. Every ending is a `Finished` in one buffer
that the queue worker writes in bulk (one Redis call for every result ready): no Redis round trip and no
asyncio task per request. Every accepted request ends in exactly one stored result: the write's first
result per attempt wins.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import orjson
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.wire import keys, store
from producer.wire.jobs import Claimed, Finished, finish_jobs, hand_back
from producer.wire.lua import done
from producer.wire.request_params import Request
from producer.wire.result_cache import CachedAnswer, cacheable
from producer.wire.results import Result, Timing
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.request import EngineRequest, EngineResult
from worker.queue.adapter import cancelled_result, engine_request, error_result, to_result
from worker.queue.cached_results import ResultCache, key_of
from worker.queue.images import IMAGES_UNSUPPORTED, ImageError, Images, ImageSource, image_urls
from worker.queue.metrics import REDIS_ERRORS_SEEN, WorkerMetrics

log = logging.getLogger("batchq.worker")

P = ParamSpec("P")
T = TypeVar("T")
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
MODEL_NOT_FOUND = "model_not_found"  # OpenAI's error code for a model it does not serve
FLUSH_MAX = 2000  # results one write call takes at most


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


def model_not_found(asked: str, cfg: WorkerConfig, adapters: bool = False) -> str:
    served = cfg.engine.model
    also = " and no LoRA adapter of that name" if adapters else ""
    return (
        f"request is for model {asked!r} but this worker serves {served!r}{also} (queue {cfg.queue!r}); "
        f"name that model, or map the name with --model-alias {asked}={served}"
    )


@dataclass(slots=True)
class Accepted:
    """A claimed job that is to run: what its result-cache lookup and its engine request are made of."""

    job_id: str
    req: Request
    raw: bytes  # the request's queue payload, kept with a retryable result
    lora: str | None
    picked_at: float
    cache_key: str | None
    images: list[str]  # the urls of its image parts, in order


@dataclass(slots=True)
class Running:
    """A request the engine has."""

    job_id: str
    req: Request
    raw: bytes
    ereq: EngineRequest
    picked_at: float
    cache_key: str | None
    handed_back: bool = False


@dataclass
class JobHandler:
    """Runs the jobs of one worker process; holds what they share."""

    cfg: WorkerConfig
    engine: AsyncEngine
    redis: Redis
    inflight: dict[str, Running] = field(default_factory=dict)  # job id -> request the engine has
    reported: dict[str, int] = field(default_factory=dict)  # job id -> tokens added to its batch's counter
    buffer: list[Finished] = field(default_factory=list)  # endings not written yet
    completed: int = 0
    failed: int = 0
    from_cache: int = 0

    def __post_init__(self) -> None:
        self.queue = keys.queue_name(self.cfg.queue)
        self.result_cache = ResultCache(self.redis, self.engine.core.fingerprint, self.cfg.result_cache_ttl_s)
        self.metrics = WorkerMetrics(self.cfg, self.engine)  # served by service.py when metrics_port is set
        self.ready = asyncio.Event()  # set when the buffer has endings to write
        self.freed = asyncio.Event()  # set when a held job was written: a slot for a new claim
        self._writing: set[str] = set()  # job ids of the write in progress
        self._starting: set[str] = set()  # job ids whose images are being read
        self.image_source = ImageSource(self.redis, self.cfg)
        # (the stand-in engine, and engines that predate images, have no takes_images)
        self.takes_images = bool(getattr(self.engine.core, "takes_images", False))

    def held(self) -> list[str]:
        """Job ids this worker holds leases on: with the engine, having their images read, or ended and
        not written yet."""
        return [*self.inflight, *self._starting, *(f.job_id for f in self.buffer), *self._writing]

    # ---- taking claimed jobs ----

    async def take(self, jobs: list[Claimed]) -> None:
        """Start every claimed job; the determined ones the result cache holds are answered from it, the
        others go to the engine once their images are read."""
        held = set(self.held())
        # a job in `held` lost its lease in an outage and the claim took it again: it is running here
        accepted = [a for job in jobs if job.job_id not in held and (a := self._accept(job)) is not None]
        self._starting = {a.job_id for a in accepted}  # their leases are renewed while this awaits
        try:
            accepted = await self._not_cached(accepted)
            images: Images = {}
            if urls := [u for a in accepted for u in a.images]:
                images = await retrying(self.image_source.stored, urls)
                images.update(await self.image_source.fetched(urls))
        finally:
            self._starting = set()
        for a in accepted:
            self._start(a, images)

    async def _not_cached(self, accepted: list[Accepted]) -> list[Accepted]:
        """Answer the requests whose answer the result cache holds (one MGET); the others."""
        lookups = [a for a in accepted if a.cache_key is not None and a.req.result_cache]
        if not lookups:
            return accepted
        raws = await retrying(self._mget, [a.cache_key or "" for a in lookups])
        answered = set()
        for a, raw in zip(lookups, raws, strict=True):
            if raw is not None:
                self._answer_from_cache(a, CachedAnswer.from_json(raw))
                answered.add(a.job_id)
        return [a for a in accepted if a.job_id not in answered]

    async def _mget(self, cache_keys: list[str]) -> list[bytes | None]:
        return list(await done(self.redis.mget(cache_keys)))

    def _accept(self, job: Claimed) -> Accepted | None:
        """The job as a request to run, or None when it ended here (its ending is in the buffer)."""
        batch_id, index, attempt = keys.split_job_id(job.job_id)
        try:
            payload: Any = orjson.loads(job.payload)["a"][0]
            req = Request.model_validate(payload)
        except (ValidationError, orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            msg = _invalid(e)
            self._end(
                job.job_id, batch_id, error_result(str(index + 1), index, "invalid_request", msg), attempt
            )
            return None
        raw = orjson.dumps(payload)
        refused = None
        lora, wrong_model = self._adapter(req)
        urls = image_urls(req)
        if job.job_try > self.cfg.max_tries:
            msg = (
                f"request failed {self.cfg.max_tries} times: a worker died or was killed while running it "
                f"(max_tries={self.cfg.max_tries})"
            )
            refused = error_result(req.id, req.index, "max_tries_exceeded", msg, req)
        elif wrong_model is not None:
            refused = error_result(req.id, req.index, MODEL_NOT_FOUND, wrong_model, req)
        elif job.cancelled:
            refused = cancelled_result(req)
        elif urls and not self.takes_images:
            msg = f"the model {self.cfg.engine.model!r} serving this queue takes no images (text only)"
            refused = error_result(req.id, req.index, IMAGES_UNSUPPORTED, msg, req)
        if refused is not None:
            self._end_req(job.job_id, req, raw, refused)
            return None
        key = None
        if self.cfg.result_cache and (fingerprint := self._fingerprint(lora)) is not None:
            key = key_of(fingerprint, req)
        return Accepted(job.job_id, req, raw, lora, time.time(), key, urls)

    def _start(self, a: Accepted, images: Images) -> None:
        """Hand an accepted job to the engine (an image it cannot have, or a request the engine refuses,
        ends it here)."""
        req = a.req
        try:
            ereq = engine_request(req, a.job_id, a.lora, images)
        except ImageError as e:
            self._end_req(a.job_id, req, a.raw, error_result(req.id, req.index, e.error_type, str(e), req))
            return
        except ValueError as e:  # the contract admits what the engine refuses: a bug, reported per request
            self._end_req(
                a.job_id, req, a.raw, error_result(req.id, req.index, "invalid_request", str(e), req)
            )
            return
        run = Running(a.job_id, req, a.raw, ereq, a.picked_at, a.cache_key)
        self.inflight[run.job_id] = run
        fut = self.engine.submit(run.ereq)
        fut.add_done_callback(functools.partial(self._engine_done, run))

    def _adapter(self, req: Request) -> tuple[str | None, str | None]:
        """(the LoRA adapter that runs the request, None for the base model; why it cannot run here, or
        None). A request names an adapter in `lora`, or in `model` (as OpenAI names a fine-tuned model)."""
        served, loras = self.cfg.engine.model, self.engine.core.loras
        serves = loras.serves if loras is not None else (lambda name: False)
        lora = req.lora
        if req.model is not None and req.model != served and req.model != lora:
            if lora is not None or not serves(req.model):
                return None, model_not_found(req.model, self.cfg, loras is not None)
            lora = req.model
        if lora is not None and not serves(lora):
            return None, model_not_found(lora, self.cfg, loras is not None)
        return lora, None

    def _fingerprint(self, lora: str | None) -> str | None:
        """What the result cache keys on: the engine's fingerprint, and an adapter's content digest (None
        where the adapter cannot be read: the engine reports why)."""
        loras = self.engine.core.loras
        if lora is None or loras is None:
            return self.result_cache.fingerprint
        digest = loras.digest(lora)
        return None if digest is None else f"{self.result_cache.fingerprint}\0lora:{digest}"

    def _answer_from_cache(self, a: Accepted, answer: CachedAnswer) -> None:
        req = a.req
        timing = Timing(queued_s=_queued_s(req, a.picked_at), total_s=time.time() - a.picked_at)
        result = answer.result(req.id, req.index, req.metadata, timing=timing, worker=self.cfg.worker_id)
        if result.model is None:  # stored before answers named their model: it is this queue's
            result.model = self.cfg.engine.model
        self.from_cache += 1
        self._end_req(a.job_id, req, a.raw, result)

    def _engine_done(self, run: Running, fut: asyncio.Future[EngineResult]) -> None:
        if run.handed_back or fut.cancelled() or self.inflight.pop(run.job_id, None) is None:
            return  # handed back on SIGTERM: another worker runs it
        res = fut.result()
        reported = self.reported.pop(run.job_id, 0)
        req = run.req
        core = self.engine.core
        result = to_result(req, res, _queued_s(req, run.picked_at), self.cfg.worker_id,
                           run.ereq.lora or self.cfg.engine.model, core.dtype_name, core.batch_invariant)  # fmt: skip
        cache_key = run.cache_key if cacheable(result) else None
        answer = b"" if cache_key is None else CachedAnswer.of(result).to_json()
        self._end_req(run.job_id, req, run.raw, result, res.completion_tokens - reported, cache_key, answer)

    # ---- endings ----

    def _end_req(
        self, job_id: str, req: Request, raw: bytes, result: Result, generated: int = 0,
        cache_key: str | None = None, answer: bytes = b"",
    ) -> None:  # fmt: skip
        result = result.model_copy(update={"attempt": req.attempt})
        self.buffer.append(Finished(job_id, req.batch_id, result, raw, generated, cache_key, answer))
        self.ready.set()

    def _end(self, job_id: str, batch_id: str, result: Result, attempt: int) -> None:
        self.buffer.append(Finished(job_id, batch_id, result.model_copy(update={"attempt": attempt})))
        self.ready.set()

    async def flush(self) -> None:
        """Write every ending in the buffer (retried through Redis outages: an ending is never lost)."""
        while self.buffer:
            batch, self.buffer = self.buffer[:FLUSH_MAX], self.buffer[FLUSH_MAX:]
            self._writing = {f.job_id for f in batch}
            try:
                written = await retrying(
                    finish_jobs, self.redis, self.queue, batch,
                    ttl_s=int(self.cfg.result_ttl_s), cache_ttl_s=int(self.cfg.result_cache_ttl_s),
                )  # fmt: skip
            finally:
                self._writing = set()
            for f, ok in zip(batch, written, strict=True):
                if ok:
                    self.metrics.observe(f.result)
                    if f.result.finish_reason == "error":
                        self.failed += 1
                    else:
                        self.completed += 1
            self.freed.set()

    # ---- while requests run ----

    async def hand_back(self) -> int:
        """SIGTERM past its grace period: the engine drops what it still runs, and those jobs are due again
        at once for another worker, without counting this try."""
        runs = list(self.inflight.values())
        for run in runs:
            run.handed_back = True
            self.engine.cancel(run.job_id)
        self.inflight.clear()
        try:
            await hand_back(self.redis, self.queue, [r.job_id for r in runs])
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("hand_back")
            log.warning(
                "could not hand back %d request(s) (%s); their leases will expire",
                len(runs),
                type(e).__name__,
            )
        return len(runs)

    async def report_generated(self) -> None:
        """Add the tokens running requests generated since the last report to their batches' rate counters,
        so `producer top` and `wait` see a batch's rate while its requests run, not only as they end."""
        counts = self.engine.generated_tokens()
        by_batch: dict[str, int] = {}
        for job_id, run in list(self.inflight.items()):
            n = counts.get(job_id, 0) - self.reported.get(job_id, 0)
            if n > 0:
                batch_id = run.req.batch_id
                by_batch[batch_id] = by_batch.get(batch_id, 0) + n
                self.reported[job_id] = counts[job_id]
        if by_batch:
            await store.add_generated(self.redis, by_batch)

    async def poll_cancellations(self) -> None:
        """Running requests of a cancelled batch stop at their next engine step."""
        for batch_id in {run.req.batch_id for run in self.inflight.values()}:
            if await store.is_cancelled(self.redis, batch_id):
                for job_id, run in list(self.inflight.items()):
                    if run.req.batch_id == batch_id:
                        self.engine.cancel(job_id)


def _queued_s(req: Request, picked_at: float) -> float | None:
    return max(0.0, picked_at - req.enqueued_at) if req.enqueued_at else None


def _invalid(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
    return f"not a batchq job payload ({type(e).__name__})"
