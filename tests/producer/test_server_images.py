"""Image lines through `producer serve` (a real server process and Redis; no worker: what serves the queue is
published by hand, as a stand-in worker would): the same refusals as `producer submit`, as a 400 naming
line and field at upload, or as the failed batch's errors where the queue changed after the upload."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
import redis

from producer.wire import keys
from producer.wire.images import image_ref
from producer.wire.workers import QueueServing
from tests.image_inputs import data_url, image, openai_chat, png, sha, text
from tests.producer.test_server import KEY_A, ApiServer, jsonl
from worker.embedded_redis import RedisServer

PHOTO = png()
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("images-api")
    store = RedisServer(appendonly=False).start()
    keys_file = tmp / "api-keys"
    keys_file.write_text(f"{KEY_A}\n")
    server = ApiServer(store.url, keys_file, tmp, "images").start()
    try:
        server.wait_ready()
        yield {"url": server.url, "redis": redis.Redis.from_url(store.url)}
    finally:
        server.kill()
        store.close()


def serve(api: dict[str, Any], images: bool) -> None:
    """What the default queue's workers publish (worker/service.py publish_serving)."""
    serving = QueueServing(model="vlm", fingerprint="ab" * 32, max_model_len=4096, images=images)
    api["redis"].set(keys.queue_serving(keys.DEFAULT_QUEUE), serving.model_dump_json())


def upload_error(c: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "file" and body["code"] == "invalid_file", body
    return str(body["message"])


def test_bad_images_are_a_400_naming_line_and_field_and_nothing_is_stored(api: dict[str, Any]) -> None:
    api["redis"].delete(keys.queue_serving(keys.DEFAULT_QUEUE))
    with openai.OpenAI(base_url=api["url"], api_key=KEY_A) as c:
        message = upload_error(c, [
            openai_chat("ok", text("what?"), image(data_url(PHOTO))),
            openai_chat("junk", text("what?"), image(data_url(b"GIF89a but not really"))),
            openai_chat("path", text("what?"), image("file://cat.png")),  # an upload has no folder
            openai_chat("many", *[image(data_url(PHOTO))] * 9),
            openai_chat("web", text("what?"), image("http://example.com/cat.png")),
        ])  # fmt: skip
        url = "body.messages.0.content.1.image_url.url"
        assert message.splitlines() == [
            "4 invalid line(s); the file was not stored:",
            f"  line 2: {url}: not a decodable image (cannot identify image file)",
            f"  line 3: {url}: file:// images need the JSONL file's folder, and this input has none (an "
            "upload, or a stream): give the image as a data: URL",
            "  line 4: body.messages: 9 images in one request, more than the limit of 8",
            f"  line 5: {url}: http(s) image URLs are not fetched by this queue's workers (worker setting "
            "image_urls = false, or no worker has said); give the image as a data: URL or a file:// path",
        ]
        assert c.files.list().data == []
    assert api["redis"].keys(keys.image("*")) == []


def test_a_text_only_queue_refuses_images_at_upload_and_at_batch_creation(api: dict[str, Any]) -> None:
    lines = [openai_chat(f"q{i}", text(f"question {i}"), image(data_url(PHOTO))) for i in range(4)]
    with openai.OpenAI(base_url=api["url"], api_key=KEY_A) as c:
        serve(api, images=False)
        message = upload_error(c, lines)
        assert ("line 1: body.messages.0.content.1.image_url.url: the model 'vlm' serving this queue takes "
                "no images (text only)") in message  # fmt: skip

        serve(api, images=True)
        f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        assert b.status == "in_progress" and b.request_counts is not None and b.request_counts.total == 4
        r = api["redis"]
        assert r.keys(keys.image("*")) == [keys.image(sha(PHOTO)).encode()]  # four questions, one photo
        assert r.zcard(keys.DEFAULT_QUEUE) == 4
        job = orjson.loads(r.get(f"arq:job:{keys.job_id(b.id, 2)}"))["a"][0]
        assert job["messages"][0]["content"][1]["image_url"]["url"] == image_ref(sha(PHOTO))

        serve(api, images=False)  # the queue changed hands between the upload and the batch
        b = c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 10
        while b.status not in ("failed", "in_progress") and time.monotonic() < deadline:
            b = c.batches.retrieve(b.id)
        assert b.status == "failed" and b.errors is not None and b.errors.data is not None, b
        first = b.errors.data[0]
        assert (first.line, first.param) == (1, "body.messages.0.content.1.image_url.url")
        assert first.message == "the model 'vlm' serving this queue takes no images (text only)"
