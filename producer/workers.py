"""Live workers: the heartbeat snapshot each worker writes (worker/health.py), read back by the producer.

A worker is live while its heartbeat key exists: it is written every `heartbeat_s` with a TTL of three
intervals, so a killed worker drops out within that time. Both sides import `Heartbeat`; fields added
later get defaults, so a producer reads the heartbeats of older workers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, ValidationError
from redis.asyncio import Redis

from producer import keys
from producer.contract import BatchStatus

STALE_MEMBER_S = 60.0  # a `batchq:workers` member this long without a heartbeat key is dropped
_QUEUE_KEY_PREFIX = keys.queue_name("x").removesuffix("x")


def queue_label(queue: str | None) -> str:
    """The short queue name a user types ("default"), from its Redis key ("batchq:queue:default")."""
    return keys.queue_name(queue).removeprefix(_QUEUE_KEY_PREFIX)


class Heartbeat(BaseModel):
    """One worker's health snapshot, rewritten every heartbeat_s."""

    model_config = ConfigDict(extra="ignore")  # a newer worker's extra fields do not break an older producer

    worker_id: str
    host: str
    queue: str  # the queue's Redis key
    model: str
    ts: float  # unix time of the snapshot
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    progress_age_s: float  # since the engine last completed a step
    stall_s: float
    version: str = "unknown"
    device: str = "unknown"
    dtype: str = "unknown"
    kv_cache_dtype: str = "unknown"
    tok_s: float = 0.0  # generated tokens per second over the last heartbeat interval
    started_at: float | None = None
    metrics_port: int | None = None  # where its Prometheus metrics are served, when they are

    @property
    def kv_pct(self) -> float:
        return 100.0 * self.kv_blocks_used / max(self.kv_blocks_total, 1)

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.ts)

    def stalled(self) -> bool:
        return self.progress_age_s > self.stall_s and self.running + self.waiting > 0

    def to_row(self, now: float | None = None) -> dict[str, object]:
        """What `producer workers --json` prints: the snapshot with the queue's short name, its age, KV %."""
        return {
            **self.model_dump(),
            "queue": queue_label(self.queue),
            "heartbeat_age_s": round(self.age_s(now), 3),
            "kv_pct": round(self.kv_pct, 1),
        }


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


class QueueServing(BaseModel):
    """What serves a queue, as its workers publish it (keys.queue_serving; one model per queue, see
    worker/service.py bind_queue): the model name requests must name or leave unset, the engine
    fingerprint the result cache keys with (when the workers use the result cache), and the longest
    sequence (prompt + output) the engine serves. It outlives the workers (its TTL is the result
    cache's), so it also describes a queue whose workers are all gone."""

    model_config = ConfigDict(extra="ignore")

    model: str
    fingerprint: str
    max_model_len: int
    result_cache: bool = True


async def queue_serving(redis: Redis, queue: str | None) -> QueueServing | None:
    """The queue's published QueueServing, or None when no worker ever published one (or it expired)."""
    raw = await redis.get(keys.queue_serving(keys.queue_name(queue)))
    if raw is None:
        return None
    try:
        return QueueServing.model_validate_json(raw)
    except ValidationError:
        return None  # written by a worker this producer cannot read: no checks, no lookups


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
