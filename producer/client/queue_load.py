"""Pending work per queue: the figure an autoscaler scales workers on (producer serve's /metrics).

A queue's pending work is the sum over its batches of what `producer status` reports as queued (in a
queue now) plus running: read from the batches' counters, which a Lua script changes with every result,
so it needs no worker to exist and counts a request from its submit until its result is stored. A
request a worker holds stays pending, so workers are never scaled in below the work they are doing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from redis.asyncio import Redis

from producer.wire import store
from producer.wire.workers import queue_label


@dataclass
class QueueLoad:
    pending: int = 0  # requests queued (in the queue now) or running
    running: int = 0  # of those, the ones a worker has started
    batches: int = 0  # batches with pending work


async def queue_loads(redis: Redis, always: Iterable[str | None] = ()) -> dict[str, QueueLoad]:
    """Short queue name -> its load, for every queue a batch in the index names and the queues `always`
    (reported at zero when idle, so that a query on them finds a series before their first batch)."""
    loads = {queue_label(q): QueueLoad() for q in always}
    async for s in store.all_statuses(redis):
        load = loads.setdefault(queue_label(s.queue), QueueLoad())
        if s.pending:
            load.pending += s.pending
            load.running += s.running
            load.batches += 1
    return loads
