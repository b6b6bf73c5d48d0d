"""Redis call helpers: Lua scripts run by SHA (reloaded after a restart flushed the script cache)."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

T = TypeVar("T")


async def done(value: Awaitable[T] | T) -> T:
    """redis-py types each command as sync-or-async; on a redis.asyncio client it is always awaitable."""
    return await cast(Awaitable[T], value)


class LuaScript:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, redis: Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return await done(redis.evalsha(self.sha, len(keys), *keys, *args))
        except NoScriptError:
            await redis.script_load(self.source)
            return await done(redis.evalsha(self.sha, len(keys), *keys, *args))
