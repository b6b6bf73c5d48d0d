"""Pending work per queue (producer/client/queue_load.py) and its Prometheus text (producer/api/metrics.py):
what an autoscaler reads, equal to `producer status`'s queued + running, from Redis alone (no worker)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from producer.api.metrics import render
from producer.api.serve import build_parser
from producer.client.queue_load import QueueLoad, queue_loads
from producer.wire import keys, store
from tests.producer.test_store import batch, result


async def test_pending_per_queue_is_queued_plus_running_with_no_worker(redis: Redis) -> None:
    await batch(redis, 5, batch_id="a")
    await batch(redis, 3, batch_id="b", queue="other")
    await batch(redis, 2, batch_id="c")
    loads = await queue_loads(redis, always=(None, "idle"))
    assert loads == {
        "default": QueueLoad(pending=7, running=0, batches=2),
        "other": QueueLoad(pending=3, running=0, batches=1),
        "idle": QueueLoad(),  # named, reported at zero before its first batch
    }
    # A worker takes two requests and finishes one of them: pending follows the batch's own counts.
    assert await store.start_attempt(redis, "a", 0) == store.START_RUN
    assert await store.start_attempt(redis, "a", 1) == store.START_RUN
    assert await store.write_result(redis, "a", result(0))
    s = await store.get_status(redis, "a")
    assert (s.queued, s.running, s.pending) == (3, 1, 4)
    assert (await queue_loads(redis))["default"] == QueueLoad(pending=6, running=1, batches=2)
    for i in range(1, 5):
        await store.write_result(redis, "a", result(i))
    for i in range(2):
        await store.write_result(redis, "c", result(i))
    # Finished batches stay in the index (results are kept) but add nothing.
    assert (await queue_loads(redis))["default"] == QueueLoad()


async def test_a_partly_enqueued_batch_counts_only_what_is_in_the_queue(redis: Redis) -> None:
    """An interrupted submit: requests it never enqueued are in no queue, so no worker could take them."""
    await batch(redis, 10, batch_id="p")
    await redis.hset(keys.batch_meta("p"), store.ENQUEUED, 4)  # as if the submit stopped after 4
    await store.start_attempt(redis, "p", 0)
    s = await store.get_status(redis, "p")
    assert s.partly_enqueued and (s.queued, s.in_queue, s.running, s.pending) == (9, 3, 1, 4)
    assert (await queue_loads(redis))["default"] == QueueLoad(pending=4, running=1, batches=1)


async def test_expired_batches_in_the_index_are_skipped(redis: Redis) -> None:
    await batch(redis, 2, batch_id="gone")
    await redis.delete(keys.batch_meta("gone"))
    assert await queue_loads(redis) == {}


def test_the_metrics_text_parses_as_prometheus_gauges_one_series_per_queue() -> None:
    text = render({"default": QueueLoad(7, 2, 1), 'we"ird\\q\n': QueueLoad()}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"batchq_queue_pending", "batchq_queue_running", "batchq_queue_batches"}
    assert all(f.type == "gauge" and f.documentation for f in families.values())
    pending = {s.labels["queue"]: s.value for s in families["batchq_queue_pending"].samples}
    assert pending == {"default": 7, 'we"ird\\q\n': 0}
    assert {s.labels["queue"]: s.value for s in families["batchq_queue_running"].samples}["default"] == 2


def test_serve_refuses_an_empty_metrics_queue_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--metrics-queue", "llama"]).metrics_queue == ["llama"]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--metrics-queue", " "])
    assert e.value.code == 2 and "--metrics-queue: expected a queue name" in capsys.readouterr().err
