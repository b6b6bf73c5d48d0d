"""What the HTTP API's file and batch stores share: OpenAI's error object and its cursor pagination.

Nothing here knows HTTP frameworks: the stores raise ApiError, producer/api/server.py turns it into a
response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from producer.wire.lua import done

DEFAULT_LIMIT, MAX_LIMIT = 20, 100  # OpenAI's list defaults


@dataclass(eq=False)  # an exception stays hashable
class ApiError(Exception):
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(kind: str, object_id: str) -> ApiError:
    """The answer for an id that does not exist and for one another API key owns: the two look the same."""
    return ApiError(404, f"No such {kind} object: {object_id!r}", param="id", code="not_found")


def parse_limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r}", param="limit")
    return limit


async def page_ids(redis: Redis, index: str, *, after: str | None, limit: int) -> tuple[list[str], bool]:
    """One page of an owner's index (a zset by creation time), newest first: the ids that come after the
    cursor `after` (an id of an earlier page), and whether more follow. An unknown cursor is a 400."""
    start = 0
    if after:
        rank = await done(redis.zrevrank(index, after))
        if rank is None:
            raise ApiError(400, f"after: no object {after!r} in this list", param="after")
        start = int(rank) + 1
    raw = await done(redis.zrevrange(index, start, start + limit))  # one more than asked: has_more
    ids = [r.decode() if isinstance(r, bytes) else str(r) for r in raw]
    return ids[:limit], len(ids) > limit


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list envelope."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
