"""A batch's counts partition it at every moment, whatever interleaving of submit, worker starts, results,
worker deaths, cancel and retry happens: queued + running + completed + failed + cancelled == total, each
request counted once, by its current attempt; the token totals are those of the results counted; the
rate counter never goes down.

Hypothesis drives the same functions the worker (its bulk claim, finish and hand-back: producer/wire/jobs.py)
and the producer (submit, cancel, retry) call, against a real Redis: real jobs, leases and try counters.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import orjson
from arq.constants import in_progress_key_prefix
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from redis.asyncio import Redis

from producer.client.retry import FINISH_REASONS, finish_reasons, retry_batch
from producer.client.submit import submit_stream
from producer.wire import keys, store
from producer.wire.jobs import Finished, claim_jobs, finish_jobs, hand_back
from producer.wire.results import ErrorInfo, Result, Usage

BID = "prop"
REASONS = ["eos", "stop", "length", "timeout", "repetition", "error", "cancelled"]


class BatchCounts(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.redis = Redis.from_url(self.url)
        self.run(self.redis.flushall())
        self.held: dict[str, dict[str, Any]] = {}  # job id -> request, jobs a live worker is running
        self.zombies: dict[str, dict[str, Any]] = {}  # jobs of workers presumed dead (leases lapsed)
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

    @rule(n=st.integers(1, 3))
    def a_worker_claims_jobs(self, n: int) -> None:
        """The worker's bulk claim (producer/wire/jobs.py); a job of a cancelled batch ends cancelled at
        once, as worker/queue/job_handler.py ends it."""
        jobs, _ = self.run(claim_jobs(self.redis, keys.DEFAULT_QUEUE, n, lease_s=60))
        for job in jobs:
            req = orjson.loads(job.payload)["a"][0]
            if job.cancelled:
                self._finish(job.job_id, req, "cancelled")
            else:
                self.held[job.job_id] = req

    @rule(pick=st.integers(0, 50), reason=st.sampled_from(REASONS), reported=st.integers(0, 3))
    def a_worker_finishes_a_job(self, pick: int, reason: str, reported: int) -> None:
        if not self.held:
            return
        jid = sorted(self.held)[pick % len(self.held)]
        req = self.held.pop(jid)
        if reported:  # tokens reported while it ran (worker/queue/job_handler.py report_generated)
            self.run(store.add_generated(self.redis, {BID: reported}))
        self._finish(jid, req, reason, generated=max(0, 2 - reported))

    @rule(pick=st.integers(0, 50))
    def a_worker_dies(self, pick: int) -> None:
        """SIGKILL: its lease lapses (the job is due again); its running mark stays. It may still write."""
        if not self.held:
            return
        jid = sorted(self.held)[pick % len(self.held)]
        self.zombies[jid] = self.held.pop(jid)
        self.run(self.redis.delete(in_progress_key_prefix + jid))
        self.run(self.redis.zadd(keys.DEFAULT_QUEUE, {jid: 0}, xx=True))

    @rule(pick=st.integers(0, 50), reason=st.sampled_from(REASONS))
    def a_presumed_dead_worker_finishes(self, pick: int, reason: str) -> None:
        if self.zombies:
            jid = sorted(self.zombies)[pick % len(self.zombies)]
            self._finish(jid, self.zombies.pop(jid), reason)

    @rule(pick=st.integers(0, 50))
    def a_worker_hands_a_job_back(self, pick: int) -> None:
        """SIGTERM past the grace period."""
        if self.held:
            jid = sorted(self.held)[pick % len(self.held)]
            del self.held[jid]
            self.run(hand_back(self.redis, keys.DEFAULT_QUEUE, [jid]))

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

    def _write(self, req: dict[str, Any], reason: str, generated: int = 0) -> None:
        self.run(store.write_result(self.redis, BID, _result(req, reason), generated=generated))

    def _finish(self, jid: str, req: dict[str, Any], reason: str, generated: int = 0) -> None:
        done = Finished(jid, BID, _result(req, reason), generated=generated)
        self.run(finish_jobs(self.redis, keys.DEFAULT_QUEUE, [done], ttl_s=3600, cache_ttl_s=60))

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


def _result(req: dict[str, Any], reason: str) -> Result:
    error = ErrorInfo(type="engine", message="x") if reason == "error" else None
    return Result(
        id=req["id"], index=req["index"], finish_reason=reason, error=error, attempt=req.get("attempt", 0),
        usage=Usage.counted(3, 2, 1), cached=reason == "stop",
    )  # fmt: skip


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
