"""`make run`'s embedded Redis, the tests' and the benchmarks': a redis-server child process on a free port.

The class and the binary's lookup live in producer/wire/redis_server.py, which `producer redis` shares (the
producer imports nothing of the worker); these names stay importable from here.
"""

from __future__ import annotations

from producer.wire.redis_server import RedisServer, free_port, redis_server_binary

__all__ = ["RedisServer", "free_port", "redis_server_binary"]
