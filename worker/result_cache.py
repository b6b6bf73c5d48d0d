"""The result cache: answers of determined requests, kept in Redis across runs for nightly jobs.

A request's output is determined when it is greedy or sampled with a seed the user gave. Such a request
is looked up before it runs, under a key of everything that decides its output: the engine's
fingerprint (weights, dtype, numerics, output-shaping settings), the prompt's token ids, and every
parameter that can change the tokens or the text. A hit completes at once with the stored answer;
unseeded sampling never hits. Only answers that ended on their own (eos, stop, length, repetition)
are stored: a timeout or a cancellation says nothing about what the model would have written.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from producer import keys
from producer.contract import FinishReason
from producer.lua import done
from worker.engine.params import GenerationParams
from worker.engine.request import EngineResult

CACHEABLE: frozenset[str] = frozenset({"eos", "stop", "length", "repetition"})
# Parameters that never change the output: how long it may take to compute it.
_NOT_OUTPUT = ("timeout_s",)
# What greedy decoding ignores: with temperature 0 the argmax is taken before any of these apply.
_GREEDY_IGNORES = ("seed", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class CachedAnswer:
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, res: EngineResult) -> CachedAnswer:
        return cls(res.text, res.finish_reason, res.prompt_tokens, res.completion_tokens, res.cached_tokens)


def output_key(fingerprint: str, prompt_ids: list[int], params: GenerationParams, seeded: bool) -> str | None:
    """The cache key of a request, or None when its output is not determined (unseeded sampling)."""
    greedy = params.temperature == 0.0
    if not greedy and not seeded:
        return None
    fields = dataclasses.asdict(params)
    for name in _NOT_OUTPUT + (_GREEDY_IGNORES if greedy else ()):
        del fields[name]
    blob = orjson.dumps([fingerprint, prompt_ids, fields], option=orjson.OPT_SORT_KEYS)
    return keys.result_cache(hashlib.sha256(blob).hexdigest())


class ResultCache:
    def __init__(self, redis: Redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def get(self, key: str) -> CachedAnswer | None:
        raw = await done(self.redis.get(key))
        if raw is None:
            return None
        return CachedAnswer(**orjson.loads(raw))

    async def put(self, key: str, res: EngineResult) -> None:
        if res.finish_reason in CACHEABLE:
            value = orjson.dumps(dataclasses.asdict(CachedAnswer.of(res)))
            await done(self.redis.set(key, value, ex=max(1, int(self.ttl_s))))
