"""The worker's side of image requests against a real Redis: the images a claimed request refers to become
its EngineRequest.images, in the order of their parts; an image that cannot be had, or an engine that
takes none, ends that request alone with an error result."""

from __future__ import annotations

import asyncio
import functools
import http.server
import io
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from producer.client.batchq_client import BatchqClient
from producer.client.submit import submit_stream
from producer.wire import keys
from producer.wire.images import image_ref
from producer.wire.request_params import Request
from producer.wire.workers import QueueServing
from tests.image_inputs import chat, data_url, image, jpeg, png, sha, text
from worker.config import STAND_IN_MODEL, WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.request import EngineRequest
from worker.queue.adapter import engine_request
from worker.queue.images import ImageError, ImageSource, image_urls
from worker.queue.job_handler import JobHandler
from worker.queue.loop import QueueWorker
from worker.queue.stand_in import InstantEngine
from worker.service import connect, publish_serving

A, B = png(), jpeg()


def config(url: str, **settings: object) -> WorkerConfig:
    return WorkerConfig(
        engine={"model": STAND_IN_MODEL, "max_num_seqs": 4}, engine_stand_in=True, redis_url=url,  # type: ignore[arg-type]
        poll_delay_s=0.01, burst=True, **settings,  # type: ignore[arg-type]
    )  # fmt: skip


class SeeingEngine(InstantEngine):
    """The stand-in as an engine that takes images, keeping each request it was given."""

    takes_images = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, EngineRequest] = {}

    def add_request(self, req: EngineRequest) -> None:
        self.seen[req.request_id] = req
        super().add_request(req)


async def load(engine: type[InstantEngine]) -> AsyncEngine:
    return await AsyncEngine.load(config("redis://x").engine, loader=engine.load)  # type: ignore[arg-type]


@pytest_asyncio.fixture
async def seeing() -> AsyncIterator[AsyncEngine]:
    engine = await load(SeeingEngine)
    yield engine
    await engine.stop()


@pytest_asyncio.fixture
async def text_only() -> AsyncIterator[AsyncEngine]:
    engine = await load(InstantEngine)
    yield engine
    await engine.stop()


async def test_stored_images_become_the_engine_requests_images_in_the_order_of_their_parts(
    redis: Redis, redis_url: str
) -> None:
    await redis.set(keys.image(sha(A)), A)
    await redis.set(keys.image(sha(B)), B)
    ref_a, ref_b = image_ref(sha(A)), image_ref(sha(B))
    req = Request.model_validate({
        "batch_id": "b", "id": "x", "index": 0, "params": {"max_new_tokens": 4},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [text("Compare"), image(ref_a), text("with"), image(ref_b)]},
            {"role": "assistant", "content": "They differ."},
            {"role": "user", "content": [image(ref_a), text("And this?")], "name": "ann"},
        ],
    })  # fmt: skip
    images = await ImageSource(redis, config(redis_url)).stored(image_urls(req))
    assert images == {ref_a: A, ref_b: B}  # each distinct image read once
    ereq = engine_request(req, "b:0", None, images)
    assert ereq.images == [A, B, A]
    assert ereq.messages == [
        {"role": "system", "content": "Be brief."},  # a text-only message is a string, as ever
        {"role": "user", "content": [text("Compare"), {"type": "image"}, text("with"), {"type": "image"}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image"}, text("And this?")], "name": "ann"},
    ]
    plain = req.model_copy(update={"messages": [req.messages[0], req.messages[2]]})  # type: ignore[index]
    assert engine_request(plain, "b:1").images is None

    await redis.delete(keys.image(sha(B)))
    gone = await ImageSource(redis, config(redis_url)).stored(image_urls(req))
    with pytest.raises(ImageError, match=r"^messages\.1\.content\.3\.image_url\.url: image sha256:") as e:
        engine_request(req, "b:0", None, gone)
    assert e.value.error_type == "image_not_found"


async def submit_images(redis: Redis) -> str:
    """Three requests: image A, image B, and text alone."""
    lines = [chat("a", text("what?"), image(data_url(A))), chat("b", image(data_url(B, "image/jpeg"))),
             {"id": "t", "messages": [{"role": "user", "content": "just text"}]}]  # fmt: skip
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    return (await submit_stream(redis, io.BytesIO(data))).batch_id


async def run_burst(cfg: WorkerConfig, engine: AsyncEngine, batch_id: str) -> dict[str, Any]:
    redis = connect(cfg)
    try:
        await asyncio.wait_for(QueueWorker(JobHandler(cfg, engine, redis), redis).main(), 30)
        return {r.id: r async for r in BatchqClient(redis).results(batch_id)}
    finally:
        await redis.aclose()


async def test_a_missing_image_ends_its_request_alone_and_the_others_run(
    redis: Redis, redis_url: str, seeing: AsyncEngine
) -> None:
    bid = await submit_images(redis)
    await redis.delete(keys.image(sha(B)))  # expired before a worker got to it
    got = await run_burst(config(redis_url), seeing, bid)
    assert (got["a"].finish_reason, got["t"].finish_reason) == ("eos", "eos")
    err = got["b"].error
    assert got["b"].finish_reason == "error" and err is not None and err.type == "image_not_found"
    assert err.message.startswith(
        f"messages.0.content.0.image_url.url: image sha256:{sha(B)} is not in Redis"
    )
    seen = seeing.core.seen  # type: ignore[attr-defined]
    assert seen[keys.job_id(bid, 0)].images == [A] and seen[keys.job_id(bid, 2)].images is None
    assert keys.job_id(bid, 1) not in seen


async def test_an_engine_without_images_refuses_image_requests_alone_and_says_so(
    redis: Redis, redis_url: str, text_only: AsyncEngine
) -> None:
    bid = await submit_images(redis)
    got = await run_burst(config(redis_url), text_only, bid)
    assert [got[k].finish_reason for k in "abt"] == ["error", "error", "eos"]
    assert got["a"].error is not None and got["a"].error.type == "images_unsupported"
    assert "takes no images" in got["a"].error.message

    handler = JobHandler(config(redis_url, image_urls=True), text_only, redis)
    await publish_serving(handler)
    serving = QueueServing.model_validate_json(await redis.get(keys.queue_serving(keys.DEFAULT_QUEUE)) or b"")
    assert (serving.images, serving.image_urls) == (False, True)


@pytest.fixture
def web(tmp_path: Path) -> Iterator[str]:
    """A local http server of tmp_path's files."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    (tmp_path / "a.png").write_bytes(A)
    (tmp_path / "big.jpg").write_bytes(B * 3)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_http_images_are_fetched_only_where_allowed_and_within_the_byte_limit(
    redis: Redis, redis_url: str, web: str
) -> None:
    urls = [f"{web}/a.png", f"{web}/big.jpg", f"{web}/nothing.png"]
    refused = await ImageSource(redis, config(redis_url)).fetched(urls)
    assert all(isinstance(v, ImageError) and v.error_type == "image_url_refused" for v in refused.values())
    fetch = ImageSource(redis, config(redis_url, image_urls=True, image_fetch_max_bytes=len(B) * 2))
    got = await fetch.fetched(urls)
    assert got[urls[0]] == A
    big, missing = got[urls[1]], got[urls[2]]
    assert isinstance(big, ImageError) and f"is more than {len(B) * 2:,} bytes" in str(big)
    assert isinstance(missing, ImageError) and "HTTP 404" in str(missing)


async def test_a_cached_answer_needs_no_image(redis: Redis, redis_url: str, seeing: AsyncEngine) -> None:
    """The result cache is looked up before images are read: an answer stored under the request's key (its
    images' references) answers it even once its image has expired."""
    from arq.constants import job_key_prefix

    from producer.wire.result_cache import CachedAnswer
    from worker.queue.cached_results import key_of

    line = chat("a", text("what?"), image(data_url(A)), temperature=0)
    bid = (await submit_stream(redis, io.BytesIO(orjson.dumps(line) + b"\n"))).batch_id
    payload = await redis.get(job_key_prefix + keys.job_id(bid, 0))
    key = key_of(InstantEngine.fingerprint, Request.model_validate(orjson.loads(payload or b"")["a"][0]))
    assert key is not None
    await redis.set(
        key, CachedAnswer(text="cat", finish_reason="eos", prompt_tokens=5, completion_tokens=1).to_json()
    )
    await redis.delete(keys.image(sha(A)))
    got = await run_burst(config(redis_url), seeing, bid)
    assert (got["a"].text, got["a"].cached) == ("cat", True)
