"""A batch's counts partition it at every moment, whatever interleaving of submit, worker starts, results,
worker deaths, cancel and retry happens: queued + running + completed + failed + cancelled == total, each
request counted once, by its current attempt; the token totals are those of the results counted; the
rate counter never goes down.

Hypothesis drives the same store and retry functions the worker (worker/jobs.py) and the producer call,
against a real Redis; the "workers" take jobs from the real arq queue and hold real lease keys.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import orjson
from arq.constants import in_progress_key_prefix, job_key_prefix
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from redis.asyncio import Redis

from producer.client.retry import FINISH_REASONS, finish_reasons, retry_batch
from producer.client.submit import submit_stream
from producer.wire import keys, store
from producer.wire.contract import ErrorInfo, Result, Usage

BID = "prop"
REASONS = ["eos", "stop", "length", "timeout", "repetition", "error", "cancelled"]


class BatchCounts(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.redis = Redis.from_url(self.url)
        self.run(self.redis.flushall())
        self.held: dict[str, dict[str, Any]] = {}  # job id -> payload, jobs a live worker is running
        self.generated = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.redis.aclose())
        self.loop.close()

    @initialize(n=st.integers(1, 6))
    def submit(self, n: int) -> None:
        lines = b"".join(b'{"id": "r%d", "prompt": "p%d"}\n' % (i, i) for i in range(n))
        self.run(submit_stream(self.redis, io.BytesIO(lines), batch_id=BID))
        self.total = n

    @rule(pick=st.integers(0, 50))
    def worker_takes_a_job(self, pick: int) -> None:
        """arq hands a queued job without a lease to a worker, which starts it (worker/jobs.py)."""
        free = [j for j in self._queued() if j not in self.held]
        if not free:
            return
        jid = free[pick % len(free)]
        self.run(self.redis.set(in_progress_key_prefix + jid, b"1"))
        req = orjson.loads(self.run(self.redis.get(job_key_prefix + jid)))["a"][0]
        start = self.run(store.start_attempt(self.redis, BID, req["index"], req.get("attempt", 0)))
        if start == store.START_NOTHING:
            self._finish_job(jid)
        elif start == store.START_CANCELLED:
            self._write(req, "cancelled")
            self._finish_job(jid)
        else:
            self.held[jid] = req

    @rule(pick=st.integers(0, 50), reason=st.sampled_from(REASONS), reported=st.integers(0, 3))
    def worker_stores_a_result(self, pick: int, reason: str, reported: int) -> None:
        if not self.held:
            return
        jid = sorted(self.held)[pick % len(self.held)]
        req = self.held.pop(jid)
        if reported:  # tokens reported while it ran (worker/jobs.py report_generated)
            self.run(store.add_generated(self.redis, {BID: reported}))
        self._write(req, reason, generated=max(0, 2 - reported))
        self._finish_job(jid)

    @rule(pick=st.integers(0, 50))
    def worker_dies(self, pick: int) -> None:
        """SIGKILL: the lease lapses, the job stays queued for another worker, its running mark stays."""
        if not self.held:
            return
        jid = sorted(self.held)[pick % len(self.held)]
        del self.held[jid]
        self.run(self.redis.delete(in_progress_key_prefix + jid))

    @rule()
    def cancel(self) -> None:
        self.run(store.cancel_batch(self.redis, BID))

    @rule(which=st.lists(st.sampled_from(sorted(FINISH_REASONS)), max_size=3, unique=True))
    def retry(self, which: list[Any]) -> None:
        self.run(retry_batch(self.redis, BID, finish_reasons(which)))

    @rule(index=st.integers(0, 5), attempt=st.integers(0, 2))
    def a_late_result_of_any_attempt(self, index: int, attempt: int) -> None:
        """A result from a worker that was presumed dead, for any attempt: refused unless it is current."""
        if index < self.total:
            self._write({"id": f"r{index}", "index": index, "attempt": attempt}, "eos")

    def _queued(self) -> list[str]:
        return [j.decode() for j in self.run(self.redis.zrange(keys.DEFAULT_QUEUE, 0, -1))]

    def _write(self, req: dict[str, Any], reason: str, generated: int = 0) -> None:
        error = ErrorInfo(type="engine", message="x") if reason == "error" else None
        res = Result(
            id=req["id"], index=req["index"], finish_reason=reason, error=error, attempt=req.get("attempt", 0),
            usage=Usage.counted(3, 2, 1), cached=reason == "stop",
        )  # fmt: skip
        self.run(store.write_result(self.redis, BID, res, generated=generated))

    def _finish_job(self, jid: str) -> None:
        async def finish() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(job_key_prefix + jid, in_progress_key_prefix + jid)
                pipe.zrem(keys.DEFAULT_QUEUE, jid)
                await pipe.execute()

        self.run(finish())

    @invariant()
    def counts_partition_the_batch(self) -> None:
        s = self.run(store.get_status(self.redis, BID))
        meta = {k.decode(): int(v) for k, v in self.run(self.redis.hgetall(keys.batch_meta(BID))).items()
                if k.decode() in ("completed", "failed", "cancelled", "retrying")}  # fmt: skip
        assert all(v >= 0 for v in meta.values()), meta
        assert s.total == self.total
        assert s.done + s.running <= s.total, s  # queued is never clamped
        assert s.queued + s.running + s.completed + s.failed + s.cancelled == s.total
        counted = [r for r, _ in self.run(_all(store.iter_results(self.redis, BID)))]
        assert len(counted) == s.done
        by = {reason: sum(r.finish_reason == reason for r in counted) for reason in REASONS}
        assert (s.failed, s.cancelled, s.timed_out, s.length) == (
            by["error"], by["cancelled"], by["timeout"], by["length"]
        )  # fmt: skip
        assert s.prompt_tokens == sum(r.usage.prompt_tokens for r in counted)
        assert s.completion_tokens == sum(r.usage.completion_tokens for r in counted)
        assert s.cached_prompt_tokens == sum(r.usage.prompt_tokens_details.cached_tokens for r in counted)
        assert s.from_result_cache == sum(r.cached for r in counted)
        attempts = self.run(store.current_attempts(self.redis, BID))
        done_idx = {r.index for r in counted}
        assert s.retrying == sum(1 for i, a in attempts.items() if a > 0 and i not in done_idx)
        assert s.tokens_generated >= self.generated  # a rate counter: never down
        self.generated = s.tokens_generated
        assert (s.state in ("completed", "cancelled")) == (s.done == s.total)


async def _all(it: Any) -> list[Any]:
    return [x async for x in it]


def test_counts_partition_the_batch_under_any_interleaving(redis_url: str) -> None:
    BatchCounts.url = redis_url
    run_state_machine_as_test(
        BatchCounts,
        settings=settings(
            max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
