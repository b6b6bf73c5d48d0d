"""The worker's side of the result cache (keys and answers: producer/wire/result_cache.py).

A job whose output is determined looks its answer up before it runs (submit already answered what was
cached when the batch came in; this catches answers stored since, by this batch's own twins or other
batches). A computed answer that ended on its own (eos, stop, length, repetition) is stored with a TTL:
a timeout or a cancellation says nothing about what the model would have written.
"""

from __future__ import annotations

from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.lua import done
from producer.wire.request_params import Request
from producer.wire.result_cache import CachedAnswer, cacheable, request_key
from producer.wire.results import Result
from producer.wire.workers import QueueServing


def key_of(fingerprint: str, req: Request) -> str | None:
    """The request's cache key, as submit computes it from the same request (None: not determined, or an
    embedding request, which the cache does not keep)."""
    if req.embedding is not None:
        return None
    messages = [m.model_dump(exclude_none=True) for m in req.messages] if req.messages is not None else None
    return request_key(
        fingerprint, req.prompt, messages, req.params.model_dump(by_alias=True, exclude_none=True)
    )


class ResultCache:
    def __init__(self, redis: Redis, fingerprint: str, ttl_s: float) -> None:
        self.redis = redis
        self.fingerprint = fingerprint
        self.ttl_s = max(1, int(ttl_s))

    async def get(self, key: str) -> CachedAnswer | None:
        raw = await done(self.redis.get(key))
        return None if raw is None else CachedAnswer.from_json(raw)

    async def put(self, key: str, res: Result) -> None:
        if not cacheable(res):
            return
        await done(self.redis.set(key, CachedAnswer.of(res).to_json(), ex=self.ttl_s))

    async def publish(
        self, queue: str, model: str, max_model_len: int, enabled: bool, embedding_size: int | None = None,
        reasoning: str | None = None, images: bool = False, image_urls: bool = False,
    ) -> None:  # fmt: skip
        """Tell producers what serves this queue: submit checks requests against it (and warns of reasoning
        fields a model without reasoning markers ignores: `reasoning` "none"; refuses image lines where the
        model takes no `images`, and http(s) image URLs unless the workers fetch them: `image_urls`) and,
        when `enabled`, answers what the result cache holds at once."""
        serving = QueueServing(
            model=model, fingerprint=self.fingerprint, max_model_len=max_model_len, result_cache=enabled,
            embedding_size=embedding_size, reasoning=reasoning, images=images, image_urls=image_urls,
        )  # fmt: skip
        await done(self.redis.set(keys.queue_serving(queue), serving.model_dump_json(), ex=self.ttl_s))
