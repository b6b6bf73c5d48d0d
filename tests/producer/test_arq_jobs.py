"""The job bytes batchq writes by hand (producer/wire/lua/: enqueue.lua, retry.lua) are arq's own: arq's
reader decodes them to what arq's writer would have written for the same job.

arq does not promise its job format; pyproject pins arq to the minor version checked here, and a new arq
that changes the format fails this test.
"""

from __future__ import annotations

import io

from arq.connections import ArqRedis
from arq.constants import job_key_prefix
from arq.jobs import Job, JobStatus, deserialize_job, deserialize_job_raw, serialize_job
from redis.asyncio import Redis

from producer.client.batchq_client import BatchqClient
from producer.client.submit import submit_stream
from producer.wire import keys, serde
from producer.wire.request_params import Request

LINES = b'{"id": "a", "prompt": "one", "max_new_tokens": 5}\n{"id": "b", "messages": [{"role": "user", "content": "two"}]}\n'
ENVELOPE = ("f", "a", "k", "t", "et")  # what serialize_job writes besides the arguments' contents


async def assert_arqs_own(redis: Redis, queue: str, job_id: str, enqueue_ms: int) -> Request:
    """The stored job, read by arq, equals field by field what arq's serialize_job writes for its function,
    arguments, job try and enqueue time; arq sees it queued at its score. Returns the request it carries."""
    raw = await redis.get(job_key_prefix + job_id)
    assert raw is not None
    job = deserialize_job(raw, deserializer=serde.job_deserializer)
    assert (job.function, job.kwargs, job.job_try, len(job.args)) == (keys.JOB_FUNCTION, {}, None, 1)
    request = Request.model_validate(job.args[0])  # the argument is batchq's contract

    theirs = serialize_job(
        keys.JOB_FUNCTION, (job.args[0],), {}, None, enqueue_ms, serializer=serde.job_serializer
    )
    ours_d, theirs_d = serde.job_deserializer(raw), serde.job_deserializer(theirs)
    assert set(ours_d) == set(theirs_d) == set(ENVELOPE)
    for name in ENVELOPE:
        assert ours_d[name] == theirs_d[name], name
    assert type(ours_d["et"]) is int  # arq's worker takes it for integer milliseconds
    expected = deserialize_job(theirs, deserializer=serde.job_deserializer)
    for name in ("function", "args", "kwargs", "job_try", "enqueue_time"):
        assert getattr(job, name) == getattr(expected, name), name
    # What arq's Worker.run_job reads.
    assert deserialize_job_raw(raw, deserializer=serde.job_deserializer) == deserialize_job_raw(
        theirs, deserializer=serde.job_deserializer
    )

    arq = ArqRedis(pool_or_conn=redis.connection_pool)
    handle = Job(job_id, arq, _queue_name=queue, _deserializer=serde.job_deserializer)
    assert await handle.status() == JobStatus.queued
    info = await handle.info()
    assert info is not None and info.score == int(await redis.zscore(queue, job_id))
    return request


async def test_submitted_jobs_are_what_arq_would_write(redis: Redis) -> None:
    report = await submit_stream(redis, io.BytesIO(LINES), batch_id="arq1", queue="arqq")
    assert report.enqueued == 2
    queue = keys.queue_name("arqq")
    enqueue_ms = int(await redis.get(keys.queue_clock(queue)))  # the millisecond this submit claimed
    for index, rid in enumerate(("a", "b")):
        job_id = keys.job_id("arq1", index)
        assert int(await redis.zscore(queue, job_id)) == enqueue_ms  # + a fraction: the in-batch order
        req = await assert_arqs_own(redis, queue, job_id, enqueue_ms)
        assert (req.id, req.index, req.batch_id, req.attempt) == (rid, index, "arq1", 0)


async def test_retried_jobs_are_what_arq_would_write(redis: Redis) -> None:
    client = BatchqClient(redis)
    await submit_stream(redis, io.BytesIO(LINES), batch_id="arq2", queue="arqq")
    assert await client.cancel("arq2") == 2  # cancelled while queued: their requests are kept for a retry
    report = await client.retry("arq2", cancelled=True)
    assert report.enqueued == 2
    queue = keys.queue_name("arqq")
    for index, rid in enumerate(("a", "b")):
        job_id = keys.job_id("arq2", index, 1)
        score = await redis.zscore(queue, job_id)
        assert score is not None and score == int(score)  # retry enqueues at a whole millisecond
        req = await assert_arqs_own(redis, queue, job_id, int(score))
        assert (req.id, req.index, req.batch_id, req.attempt) == (rid, index, "arq2", 1)
