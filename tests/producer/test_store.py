"""Batch state through the functions the worker calls: results, counters, status, wait, cancel, listing."""

from __future__ import annotations

import asyncio
import io

import pytest
from arq.constants import in_progress_key_prefix, job_key_prefix
from redis.asyncio import Redis

from producer.client.batchq_client import BatchqClient, WaitTimeout
from producer.client.submit import submit_stream
from producer.wire import keys, store
from producer.wire.results import BatchStatus, ErrorInfo, Result, Usage


def lines(n: int) -> bytes:
    return b"".join(b'{"id": "r%d", "prompt": "p%d", "metadata": {"n": %d}}\n' % (i, i, i) for i in range(n))


def result(i: int, reason: str = "eos", p: int = 3, c: int = 2) -> Result:
    error = ErrorInfo(type="engine", message="boom") if reason == "error" else None
    return Result(
        id=f"r{i}", index=i, text=f"out{i}", finish_reason=reason,
        usage=Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c), error=error,
    )  # fmt: skip


async def batch(redis: Redis, n: int, batch_id: str = "b1", **kw: object) -> None:
    await submit_stream(redis, io.BytesIO(lines(n)), batch_id=batch_id, **kw)  # type: ignore[arg-type]


async def test_first_result_write_wins_and_counts_once(redis: Redis) -> None:
    await batch(redis, 3)
    assert await store.write_result(redis, "b1", result(0)) is True
    assert await store.write_result(redis, "b1", result(0, "error", 100, 100)) is False
    assert await store.start_attempt(redis, "b1", 0) == store.START_NOTHING  # nothing left to run
    assert await store.start_attempt(redis, "b1", 1) == store.START_RUN
    s = await store.get_status(redis, "b1")
    assert (s.completed, s.failed, s.prompt_tokens, s.completion_tokens) == (1, 0, 3, 2)
    assert (s.state, s.queued, s.running, s.finished_at) == ("running", 1, 1, None)


async def test_a_duplicate_run_never_leaves_a_finished_request_counted_as_running(redis: Redis) -> None:
    """A lease expired while worker A ran request 0, so worker B started it too; A's result is stored
    first. B's start and its late result must both leave the counts adding up to the total."""
    await batch(redis, 2)
    assert await store.start_attempt(redis, "b1", 0) == store.START_RUN  # worker A
    assert await store.start_attempt(redis, "b1", 0) == store.START_RUN  # worker B, before A's result
    assert await store.write_result(redis, "b1", result(0))  # A's result
    assert await store.start_attempt(redis, "b1", 0) == store.START_NOTHING  # a third taker runs nothing
    assert not await store.write_result(redis, "b1", result(0))  # B's result: refused
    s = await store.get_status(redis, "b1")
    assert (s.queued, s.running, s.completed) == (1, 0, 1)
    assert s.queued + s.running + s.completed + s.failed + s.cancelled == s.total


async def test_counters_by_finish_reason_and_finish_sets_ttl(redis: Redis) -> None:
    await batch(redis, 7, result_ttl_s=1234)
    reasons = ["eos", "stop", "length", "timeout", "repetition", "error", "cancelled"]
    for i, reason in enumerate(reasons):
        await store.write_result(redis, "b1", result(i, reason))
        if i < len(reasons) - 1:  # nothing expires before the batch is done
            assert await redis.ttl(keys.batch_results("b1")) == await redis.ttl(keys.batch_meta("b1")) == -1
    s = await store.get_status(redis, "b1")
    # It holds a cancelled result: the state follows the counts (store.batch_state), not a cancel flag.
    assert (s.completed, s.failed, s.cancelled, s.queued, s.state) == (5, 1, 1, 0, "cancelled")
    assert (s.eos, s.stop, s.timed_out, s.length, s.repetition) == (1, 1, 1, 1, 1)  # of the completed ones
    assert s.finish_reasons() == dict.fromkeys(
        ["eos", "stop", "length", "timeout", "repetition", "cancelled", "error"], 1
    )
    assert s.finished_at is not None and s.finished_at >= s.created_at
    assert (s.prompt_tokens, s.completion_tokens) == (21, 14)
    for key in (keys.batch_meta("b1"), keys.batch_results("b1")):
        assert 1200 < await redis.ttl(key) <= 1234


async def test_running_set_drives_state_and_queued_count(redis: Redis) -> None:
    await batch(redis, 3)
    assert (await store.get_status(redis, "b1")).state == "queued"
    assert await store.start_attempt(redis, "b1", 1) == store.START_RUN
    s = await store.get_status(redis, "b1")
    assert (s.state, s.running, s.queued) == ("running", 1, 2)
    await store.write_result(redis, "b1", result(1))  # storing the result also clears "running"
    s = await store.get_status(redis, "b1")
    assert (s.running, s.queued, s.completed) == (0, 2, 1)


async def test_unknown_batch_is_a_clear_error(redis: Redis) -> None:
    with pytest.raises(store.BatchNotFound, match="unknown batch id 'nope'"):
        await store.get_status(redis, "nope")


async def test_results_come_in_input_order_across_chunks(redis: Redis) -> None:
    await batch(redis, 23)
    for i in reversed(range(23)):
        if i != 5:  # one request still running
            await store.write_result(redis, "b1", result(i))
    got = [r async for r, _ in store.iter_results(redis, "b1", chunk=4)]
    assert [r.index for r in got] == [i for i in range(23) if i != 5]
    assert got[0].to_user_json().startswith(b'{"id":"r0","text":"out0","finish_reason":"eos"')


async def test_cancel_drops_queued_jobs_and_leaves_held_ones_to_the_worker(redis: Redis) -> None:
    await batch(redis, 4)
    await store.write_result(redis, "b1", result(0))
    await redis.set(in_progress_key_prefix + keys.job_id("b1", 1), b"1")  # a worker holds request 1
    assert await store.start_attempt(redis, "b1", 1) == store.START_RUN
    assert not await store.is_cancelled(redis, "b1")

    assert await store.cancel_batch(redis, "b1") == 2
    assert await store.is_cancelled(redis, "b1")
    assert await redis.zrange(keys.DEFAULT_QUEUE, 0, -1) == [b"b1:1"]
    assert not await redis.exists(job_key_prefix + "b1:2", job_key_prefix + "b1:3")
    s = await store.get_status(redis, "b1")
    assert (s.state, s.cancelled, s.running, s.queued) == ("running", 2, 1, 0)
    cancelled = [r async for r, _ in store.iter_results(redis, "b1")][1:]
    assert [(r.id, r.finish_reason, r.metadata) for r in cancelled] == [
        ("r2", "cancelled", {"n": 2}), ("r3", "cancelled", {"n": 3})
    ]  # fmt: skip
    # The worker then stops request 1 and stores it as cancelled: the batch ends "cancelled".
    await store.write_result(redis, "b1", result(1, "cancelled", 3, 1))
    s = await store.get_status(redis, "b1")
    assert (s.state, s.done, s.total) == ("cancelled", 4, 4) and s.finished_at is not None


async def test_cancelling_a_finished_batch_changes_nothing(redis: Redis) -> None:
    await batch(redis, 1)
    await store.write_result(redis, "b1", result(0))
    assert await store.cancel_batch(redis, "b1") == 0
    assert (await store.get_status(redis, "b1")).state == "completed"


async def test_list_batches_newest_first_and_forgets_expired_ones(redis: Redis) -> None:
    for bid in ("old", "mid", "new"):
        await batch(redis, 1, bid)
        await asyncio.sleep(0.002)
    await redis.delete(keys.batch_meta("mid"))  # as if its TTL had passed
    assert [s.batch_id for s in await store.list_batches(redis)] == ["new", "old"]
    assert await redis.zcard(keys.BATCHES) == 2


async def test_wait_reports_progress_and_returns_when_done(redis_url: str, redis: Redis) -> None:
    await batch(redis, 3)
    seen: list[BatchStatus] = []

    async def worker() -> None:
        for i in range(3):
            await asyncio.sleep(0.05)
            await store.write_result(redis, "b1", result(i, "error" if i == 2 else "eos"))

    async with BatchqClient.from_url(redis_url) as client:
        task = asyncio.create_task(worker())
        final = await client.wait("b1", timeout=10, on_progress=seen.append, poll_s=0.02)
        await task
        assert (final.completed, final.failed, final.state) == (2, 1, "completed")
        assert seen[0].done < 3 and seen[-1].done == 3

        await batch(redis, 1, "slow")
        with pytest.raises(WaitTimeout) as e:
            await client.wait("slow", timeout=0.1, poll_s=0.02)
        assert e.value.status.done == 0
