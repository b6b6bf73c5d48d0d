"""Shared fixtures: a real redis-server (no mocks), and every async test on the one session event loop.

`redis_server` is one server for the session (AOF on, so kill/restart keeps acknowledged writes);
`redis_url` hands a test that server flushed clean; `redis` is an async client on it. Tests that kill
Redis on purpose should use `redis_server_factory` (their own server) so they cannot disturb others.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
import redis as sync_redis
from redis.asyncio import Redis

from worker.embedded_redis import RedisServer

if TYPE_CHECKING:
    from tests.worker.conftest import Worker

# Test modules share helpers as `tests.<area>.conftest`; the `pytest` script does not put the repo root on
# sys.path by itself (only `python -m pytest` does), so do it here, once, for every area.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pyproject puts async fixtures on the session loop; tests must share it, or a client made by a
    # fixture would be used from another loop. This is pytest-asyncio's documented recipe.
    session_loop = pytest.mark.asyncio(loop_scope="session")
    for item in items:
        if pytest_asyncio.is_async_test(item):
            item.add_marker(session_loop, append=False)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True, appendfsync="everysec") as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.start()  # a no-op unless an earlier test left it stopped
    client = sync_redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest_asyncio.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start servers of the test's own (kill/restart freely); all are stopped at the end of the test."""
    started: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(**kwargs).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama with SmolLM2's tokenizer: real loading code, fast workers, long contexts."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tests.tiny_models import tiny_config
    from worker.models.resolve import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))
    cfg = tiny_config(
        "llama",
        vocab_size=len(tok),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def shared_worker(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RedisServer, Worker]]:
    """One worker process on the tiny model and a Redis of its own, shared by the modules that only need
    requests answered (retry, OpenAI output). Batch ids and prompts of each test are its own."""
    from tests.worker.conftest import Worker

    with RedisServer(appendonly=False) as server:
        args = ["--max-num-seqs", "4", "--repetition-repeats", "0", "--lease-s", "2", "--kv-cache-gb", "0.05",
                "--poll-delay-s", "0.05"]  # fmt: skip
        worker = Worker(
            server.url, str(tiny_model_dir), tmp_path_factory.mktemp("shared-worker"), "shared", *args
        )
        try:
            yield server, worker.wait_ready()
        finally:
            worker.stop()
