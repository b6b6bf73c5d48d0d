"""The worker's queue loop: claim due jobs in bulk, keep their leases, write their results in bulk.

Jobs are arq's (one per request: `arq:job:<id>` in the queue zset, written by `producer submit` and
`producer retry`); the loop is batchq's own. arq's Worker spends a dozen Redis round trips and an asyncio
task on each job, so one worker process's own CPU capped its request rate whatever the engine did
(benchmarks/queue_bench.py measures it). Here:

- claim: one Lua call takes up to the free slots' worth of due jobs no worker holds, leases them, counts
  their tries and starts their attempts (producer/wire/jobs.py). Leased jobs move out of the queue's due
  range, so no claim reads past jobs other workers hold and an added worker finds work at once.
- write: endings collect in the handler's buffer and one call writes them all with the batches' counters
  and dequeues their jobs, while the next ones compute.
- leases: renewed every lease_s / 3 for every job held; a SIGKILLed worker's jobs are due again after
  lease_s. SIGTERM stops claiming, lets in-flight work finish within the grace period, and hands the rest
  back without counting the try.
- Redis outages: every call backs off and retries; endings wait in the buffer, none is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis

from producer.wire.jobs import claim_jobs, renew_leases
from worker.queue.job_handler import REDIS_ERRORS, JobHandler
from worker.queue.metrics import REDIS_ERRORS_SEEN

log = logging.getLogger("batchq.worker")


class QueueWorker:
    def __init__(self, handler: JobHandler, redis: Redis) -> None:
        self.handler = handler
        self.redis = redis
        self.cfg = handler.cfg
        self.queue = handler.queue
        self.max_jobs = self.cfg.max_jobs
        self.allow_claims = True
        self._backoff = 0.0
        self._writer: asyncio.Task[None] | None = None

    async def main(self) -> None:
        """Claim and run jobs until drained (SIGTERM), cancelled, or, in burst mode, the queue is empty."""
        self._writer = asyncio.create_task(self._write_loop())
        try:
            while self.allow_claims:
                if not await self.claim_once():
                    if self.cfg.burst and not self.handler.held():
                        break
                    await self._idle()
            while self.handler.inflight:  # draining: what runs finishes (or is handed back)
                await asyncio.sleep(0.05)
            await self.finish_writes()
        finally:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer

    async def claim_once(self) -> bool:
        """Claim what the free slots take: True when the queue may have more due jobs right now."""
        free = self.max_jobs - len(self.handler.held())
        if free <= 0:
            self.handler.freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.handler.freed.wait(), self.cfg.poll_delay_s)
            return True
        try:
            jobs, _dropped = await claim_jobs(self.redis, self.queue, free, self.cfg.lease_s)
        except REDIS_ERRORS as e:
            REDIS_ERRORS_SEEN.note("poll", retried=True)
            self._backoff = min(max(self._backoff * 2, 0.2), 5.0)
            log.warning("redis unavailable (%s); polling again in %.1fs", type(e).__name__, self._backoff)
            await asyncio.sleep(self._backoff)
            return True
        if self._backoff:
            log.info("redis reachable again")
            self._backoff = 0.0
        if jobs:
            await self.handler.take(jobs)
        return len(jobs) == free

    async def _idle(self) -> None:
        """Nothing due: wait a poll interval, or less when a held job ends (work may be waiting)."""
        self.handler.freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.handler.freed.wait(), self.cfg.poll_delay_s)

    async def _write_loop(self) -> None:
        while True:
            await self.handler.ready.wait()
            self.handler.ready.clear()
            await self.handler.flush()

    async def finish_writes(self) -> None:
        """Write what is buffered now (shutdown): the writer may be mid-call, so wait for both."""
        while self.handler.buffer or self.handler._writing:
            if self.handler.buffer and not self.handler._writing:
                await self.handler.flush()
            else:
                await asyncio.sleep(0.01)

    async def renew_leases(self) -> None:
        """Extend the lease of every job this worker holds; called every lease_s / 3."""
        await renew_leases(self.redis, self.queue, self.handler.held(), self.cfg.lease_s)

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: stop claiming, let in-flight work finish within grace_s, hand the rest back."""
        self.allow_claims = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.handler.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.handler.inflight:
            log.info("grace period over: handing %d request(s) back to the queue", len(self.handler.inflight))
            await self.handler.hand_back()
