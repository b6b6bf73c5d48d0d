"""arq's Worker, adapted to batch inference: short renewable leases, Redis outages survived, graceful hand-back.

What changes from plain arq, and why:
- The in-progress key is a lease of `lease_s` (not job timeout + 10 s) that live workers renew, so a
  SIGKILLed worker's requests are re-run within seconds.
- Redis errors in the poll loop are logged and retried with backoff instead of ending the worker.
- Before starting jobs, ids already leased elsewhere are filtered with one pipelined round trip; when
  other workers hold the whole page the poll read, the next page is read, so added workers find work.
- A Redis outage while leasing a job neither leaks its job slot nor ends the worker.
- Tries are counted by the job itself (arq's own limit is set out of reach) so that a request which
  keeps killing workers ends in a recorded error result rather than vanishing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq.constants import in_progress_key_prefix
from arq.utils import timestamp_ms
from arq.worker import Worker, func
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, WatchError

from producer.wire import keys, serde
from worker.jobs import REDIS_ERRORS, JobHandler, retrying
from worker.metrics import REDIS_ERRORS_SEEN

log = logging.getLogger("batchq.worker")

ARQ_MAX_TRIES = 1_000_000  # batchq counts tries itself (JobHandler.run)
JOB_TIMEOUT_S = 30 * 24 * 3600  # per-request timeout_s is enforced by the engine, not by arq
MAX_SCAN = 10_000  # queue ids one poll reads at most while looking past leased ones


async def run_request(ctx: dict[str, Any], payload: Any) -> str:
    handler: JobHandler = ctx["handler"]
    return await handler.run(payload, job_id=ctx["job_id"], job_try=ctx["job_try"])


class QueueWorker(Worker):
    def __init__(self, handler: JobHandler, **kwargs: Any) -> None:
        cfg = handler.cfg
        super().__init__(
            functions=[func(run_request, name=keys.JOB_FUNCTION, max_tries=ARQ_MAX_TRIES)],
            queue_name=keys.queue_name(cfg.queue),
            max_jobs=cfg.max_jobs,
            # arq reads max_jobs * 5 ids a poll by default; each costs an EXISTS, which on a small
            # machine takes CPU from the engine. A page of max_jobs ids, and the next one only when
            # other workers hold all of it (start_jobs).
            queue_read_limit=cfg.max_jobs,
            job_timeout=JOB_TIMEOUT_S,
            keep_result=0,
            poll_delay=cfg.poll_delay_s,
            max_tries=ARQ_MAX_TRIES,
            handle_signals=False,
            ctx={"handler": handler},
            burst=cfg.burst,
            log_results=False,
            # Without these arq falls back to pickle: orjson only, and a pickle is refused.
            job_serializer=serde.job_serializer,
            job_deserializer=serde.job_deserializer,
            **kwargs,
        )
        self.handler = handler
        self._backoff = 0.0

    async def _poll_iteration(self) -> None:
        try:
            await super()._poll_iteration()
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("poll", retried=True)
            self._backoff = min(max(self._backoff * 2, 0.2), 5.0)
            log.warning("redis unavailable (%s); polling again in %.1fs", type(e).__name__, self._backoff)
            await asyncio.sleep(self._backoff)
            return
        if self._backoff:
            log.info("redis reachable again")
            self._backoff = 0.0

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """Lease and start polled jobs that no live worker holds, reading past the leased head.

        Replaces arq's start_jobs, which (1) on a Redis outage mid-start leaked the job slot it had
        taken (a few outages and the worker never polled again) and let the WatchError that redis-py
        raises for a connection lost under WATCH end the worker's main loop; and (2) only looked at the
        `queue_read_limit` ids a poll read: jobs stay in the queue while they run, so with one worker
        holding the head of the queue, a second saw only leased ids and sat idle while the rest of the
        batch waited. Here every path that starts no task gives its slot back, a lost connection is an
        outage like any other, and a poll whose page held no free job reads the next page.
        """
        offset = 0
        while job_ids:
            for jid in await self._unleased(job_ids):
                if not await self._start_one(jid.decode()):
                    return  # every job slot is taken
            if self.job_counter >= self.max_jobs or len(job_ids) < self.queue_read_limit:
                return
            offset += len(job_ids)
            if offset >= MAX_SCAN:
                return
            job_ids = await self.pool.zrangebyscore(
                self.queue_name,
                min=float("-inf"),
                max=timestamp_ms(),
                start=offset,
                num=self.queue_read_limit,
            )

    async def _unleased(self, job_ids: list[bytes]) -> list[bytes]:
        """The ids no worker holds a lease on, in one round trip.

        A job this worker still runs whose lease lapsed while Redis was down is back in reach of every
        poll: its lease is taken again here instead of starting it twice (the engine refuses a second
        request under the same id, and arq would drop the first task unobserved).
        """
        ms = int(self.handler.cfg.lease_s * 1000)
        mine = {jid for jid in job_ids if (t := self.tasks.get(jid.decode())) is not None and not t.done()}
        async with self.pool.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                if jid in mine:
                    pipe.psetex(in_progress_key_prefix + jid.decode(), ms, b"1")
                else:
                    pipe.exists(in_progress_key_prefix + jid.decode())
            leased = await pipe.execute()
        return [jid for jid, busy in zip(job_ids, leased, strict=True) if jid not in mine and not busy]

    async def _start_one(self, job_id: str) -> bool:
        """Take a job slot and try to start `job_id` in it; False when no slot is free."""
        await self.sem.acquire()
        if self.job_counter >= self.max_jobs:
            self.sem.release()
            return False
        self.job_counter += 1
        started = False
        try:
            started = await self._lease_and_start(job_id, int(self.handler.cfg.lease_s * 1000))
        finally:
            if not started:
                self.job_counter -= 1
                self.sem.release()
        return True

    async def _lease_and_start(self, job_id: str, lease_ms: int) -> bool:
        """Take the job's lease in one WATCH/MULTI and start its task; False when another worker won it."""
        in_progress_key = in_progress_key_prefix + job_id
        try:
            async with self.pool.pipeline(transaction=True) as pipe:
                await pipe.watch(in_progress_key)
                ongoing = await pipe.exists(in_progress_key)
                score = await pipe.zscore(self.queue_name, job_id)
                if ongoing or not score or score > timestamp_ms():
                    return False  # running elsewhere, finished, or re-enqueued for later
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.psetex(in_progress_key, lease_ms, b"1")
                await pipe.execute()
        except WatchError as e:
            if isinstance(e.__context__, REDIS_ERRORS):
                raise RedisConnectionError(f"connection lost while leasing {job_id}") from e
            return False  # another worker took the lease between our WATCH and EXEC
        except ResponseError:
            return False
        task = self.loop.create_task(self.run_job(job_id, int(score)))
        task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
        self.tasks[job_id] = task
        return True

    async def run_job(self, job_id: str, score: int) -> None:
        """arq's job task, with a Redis outage in its opening reads survived.

        arq's run_job starts with one MULTI/EXEC (payload, try counter); when Redis went down between
        the poll and that read, the task died with the error, which asyncio logged as never retrieved.
        Nothing had run then (the transaction did not apply): the lease lapses and a poll picks the
        job up again once Redis is back. Its other Redis writes are finish_job (retried below) and the
        failed-job paths, where the same holds: the job stays queued and runs again.
        """
        try:
            await super().run_job(job_id, score)
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("start")
            log.warning(
                "request %s not started: redis unavailable (%s); it runs again after its lease",
                job_id,
                type(e).__name__,
            )

    async def finish_job(self, *args: Any, **kwargs: Any) -> None:
        """arq's end of a job (dequeue, delete its keys), retried through a Redis outage.

        The result is stored by then; without the retry the job stays queued and runs again, only to
        find its result, and arq logs the lost task's exception as never retrieved.
        """
        await retrying(super().finish_job, *args, **kwargs)

    async def renew_leases(self) -> None:
        """Extend the lease of every job this worker runs; called every lease_s / 3."""
        job_ids = list(self.tasks)
        if not job_ids:
            return
        ms = int(self.handler.cfg.lease_s * 1000)
        async with self.pool.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.pexpire(in_progress_key_prefix + jid, ms)
            await pipe.execute()

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: stop pulling, let in-flight work finish within grace_s, hand the rest back."""
        self.allow_pick_jobs = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(not t.done() for t in self.tasks.values()) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        pending = [t for t in self.tasks.values() if not t.done()]
        if pending:
            log.info("grace period over: handing %d request(s) back to the queue", len(pending))
            self.handler.handing_back = True
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
