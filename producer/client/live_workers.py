"""Reading what workers publish: the live workers (from their heartbeats), what serves a queue, the
warning that no live worker serves the queue a batch waits on, and submit's warning that the queue's model
ignores the reasoning fields a batch sets.

A worker is live while its heartbeat key exists: it is written every `heartbeat_s` with a TTL of three
intervals, so a killed worker drops out within that time. The records themselves are the wire's
(producer/wire/workers.py): the worker imports those, never this module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.results import BatchStatus
from producer.wire.workers import Heartbeat, QueueServing, queue_label

STALE_MEMBER_S = 60.0  # a `batchq:workers` member this long without a heartbeat key is dropped


async def live_workers(redis: Redis, queue: str | None = None) -> list[Heartbeat]:
    """Workers whose heartbeat has not expired (those on `queue` only, when given), by worker id."""
    members = [(m.decode(), score) for m, score in await redis.zrange(keys.WORKERS, 0, -1, withscores=True)]
    if not members:
        return []
    raws = await redis.mget([keys.worker_heartbeat(m) for m, _ in members])
    live, dead = [], []
    for (member, last_beat), raw in zip(members, raws, strict=True):
        if raw is None:  # expired: the member outlives its heartbeat; drop the long-dead ones
            if last_beat < time.time() - STALE_MEMBER_S:
                dead.append(member)
            continue
        try:
            live.append(Heartbeat.model_validate_json(raw))
        except ValidationError:
            continue  # a heartbeat this producer cannot read is not a worker it can describe
    if dead:
        await redis.zrem(keys.WORKERS, *dead)
    if queue is not None:
        live = [w for w in live if w.queue == keys.queue_name(queue)]
    return sorted(live, key=lambda w: w.worker_id)


async def queue_serving(redis: Redis, queue: str | None) -> QueueServing | None:
    """The queue's published QueueServing, or None when no worker ever published one (or it expired)."""
    raw = await redis.get(keys.queue_serving(keys.queue_name(queue)))
    if raw is None:
        return None
    try:
        return QueueServing.model_validate_json(raw)
    except ValidationError:
        return None  # written by a worker this producer cannot read: no checks, no lookups


REASONING_FIELDS = ("max_reasoning_tokens", "reasoning_effort")


def ignores_reasoning(serving: QueueServing) -> bool:
    """Whether the model serving the queue has no reasoning markers, as its workers said: it ignores
    REASONING_FIELDS (a worker that did not say, `reasoning` None, is not taken to ignore them)."""
    return serving.reasoning == "none"


def sets_reasoning(params: Mapping[str, Any]) -> bool:
    """Whether a request's resolved parameters set any of REASONING_FIELDS."""
    return any(params.get(k) is not None for k in REASONING_FIELDS)


def reasoning_ignored(count: int, serving: QueueServing, queue: str | None) -> str:
    """Submit's warning, once per batch: `count` requests set reasoning fields the queue's model ignores."""
    some = "1 request sets" if count == 1 else f"{count} requests set"
    return (
        f"warning: {some} {'/'.join(REASONING_FIELDS)}, but the model serving queue {queue_label(queue)!r} "
        f"({serving.model}) has no reasoning markers: they are ignored"
    )


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class NoWorkerWarning:
    """Warns once, through `say`, when no live worker serves the queue a batch is waiting on.

    Called with every polled status: it looks the workers up at the first call and then every `every_s`
    until it has warned, and not at all once the batch is done.
    """

    def __init__(self, redis: Redis, say: Callable[[str], None] = _to_stderr, every_s: float = 10.0) -> None:
        self.redis = redis
        self.say = say
        self.every_s = every_s
        self.warned = False
        self._next = float("-inf")

    async def __call__(self, status: BatchStatus) -> None:
        now = time.monotonic()
        if self.warned or status.done >= status.total or now < self._next:
            return
        self._next = now + self.every_s
        if await live_workers(self.redis, status.queue):
            return
        self.warned = True
        q = queue_label(status.queue)
        self.say(
            f"warning: no live worker serves queue {q!r} (no worker heartbeat in this Redis): batch "
            f"{status.batch_id} waits until one starts, e.g. `worker --queue {q} --model ...`"
        )
