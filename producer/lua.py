"""A Lua script run by SHA, loaded on first use (and again after a Redis restart flushed the cache)."""

from __future__ import annotations

import hashlib
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError


class LuaScript:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, redis: Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await redis.script_load(self.source)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)

    async def load(self, redis: Redis) -> None:
        """Load before pipelining EVALSHA calls, where a NoScriptError cannot be retried per call."""
        await redis.script_load(self.source)
