"""Redis URLs, one parser for every side that connects (producer, HTTP server, worker).

redis://, rediss:// (TLS) and unix:// go to redis-py as they are. High availability through Redis Sentinel:

    redis+sentinel://[user:password@]host1:26379,host2:26379/mymaster[/db]

names the sentinels (port default 26379), the monitored master's name and the database. The credentials
are the master's; the sentinels are asked without them. Connections follow the master the sentinels
report, so after a failover they reconnect to the promoted replica (docs/architecture.md says what a
failover can lose and how the lease brings it back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEME = "redis+sentinel://"
SENTINEL_PORT = 26379
_SENTINEL_TIMEOUTS = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0}


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def _host_port(item: str, url_for_errors: str) -> tuple[str, int]:
    host, port = item, str(SENTINEL_PORT)
    if item.startswith("["):  # [::1]:26379
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":") or port
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"sentinel address {item!r} is not host[:port] in {url_for_errors}")
    return host, int(port)


def parse_sentinel(url: str) -> SentinelURL | None:
    """The parts of a redis+sentinel:// URL; None for any other URL. Raises ValueError when malformed."""
    if not url.startswith(SENTINEL_SCHEME):
        return None
    shape = "redis+sentinel://[user:password@]host1:26379,host2:26379/master[/db]"
    rest = url[len(SENTINEL_SCHEME) :].partition("?")[0].partition("#")[0]
    cred, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"a Sentinel URL is {shape}")
    username, password = None, None
    if cred:
        user, colon, secret = cred.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(h, shape) for h in hosts.split(",") if h)
    return SentinelURL(
        sentinels, unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0, username, password
    )


class _SentinelPool(SentinelConnectionPool):
    """Closes the connections to the sentinels too, when the client closes the pool."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # a full close (a master change disconnects idle connections only)
            for client in self.sentinel_manager.sentinels:
                await client.aclose()


def pool_from_url(url: str, **kwargs: Any) -> ConnectionPool:
    """A connection pool for `url`; kwargs are connection options (timeouts, retry, health checks)."""
    s = parse_sentinel(url)
    if s is None:
        return ConnectionPool.from_url(url, **kwargs)
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs=dict(_SENTINEL_TIMEOUTS))  # type: ignore[no-untyped-call]
    return _SentinelPool(  # type: ignore[no-untyped-call]
        s.master, sentinel, db=s.db, username=s.username, password=s.password, **kwargs
    )


def connect(url: str, **kwargs: Any) -> Redis:
    """An asyncio client for `url` (redis://, rediss://, unix:// or redis+sentinel://) that owns its pool."""
    return Redis.from_pool(pool_from_url(url, **kwargs))
