"""What workers publish about themselves, read by both sides: the heartbeat snapshot each worker writes
(worker/queue/health.py) and what serves a queue (worker/queue/cached_results.py).

Fields added later get defaults, and unknown fields are ignored, so producers and workers of different
versions read each other's records. Reading them back (live workers, the no-worker warning, submit's
checks) is the client's: producer/client/live_workers.py.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from producer.wire import keys

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
    loras: list[str] = []  # the LoRA adapters resident in its engine's slots now

    @property
    def model_and_adapters(self) -> str:
        """Its model, and the adapters resident over it: "base (+sentiment, pii)"."""
        return self.model + (f" (+{', '.join(self.loras)})" if self.loras else "")

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


class QueueServing(BaseModel):
    """What serves a queue, as its workers publish it (keys.queue_serving; one model per queue, see
    worker/service.py bind_queue): the model name requests must name or leave unset, the engine
    fingerprint the result cache keys with (when the workers use the result cache), the longest
    sequence (prompt + output) the engine serves, how the model marks its thinking, and whether it takes
    images (and fetches http(s) image URLs). It outlives the workers (its TTL is the result cache's), so it
    also describes a queue whose workers are all gone."""

    model_config = ConfigDict(extra="ignore")

    model: str
    fingerprint: str
    max_model_len: int
    result_cache: bool = True
    embedding_size: int | None = None  # the width of its embeddings (None: unknown, or it cannot embed)
    # its reasoning parser (worker/engine/reasoning.py): "think", "harmony", or "none" where the model has no
    # reasoning markers and ignores max_reasoning_tokens / reasoning_effort (None: a worker that did not say)
    reasoning: str | None = None
    # whether its model takes images in chat messages (None: a worker that did not say: submit lets image
    # lines through, and such a worker answers each with an error)
    images: bool | None = None
    # whether its workers fetch http(s) image URLs themselves (worker setting image_urls); else submit
    # refuses them: only images it stored can be counted on to be there, and to be what was validated
    image_urls: bool = False
