"""Images in chat lines at submit, against a real Redis: data: and file:// images are validated, stored once by
content and referred to from the queued requests; every image that cannot run is refused by line and field
with nothing enqueued, through the Python client and through `producer submit` itself."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from arq.constants import job_key_prefix
from redis.asyncio import Redis

from producer.client.batchq_client import BatchqClient
from producer.client.submit import ImageLimits, InputError, submit_stream
from producer.wire import keys
from producer.wire.images import image_ref
from producer.wire.request_params import Request
from producer.wire.result_cache import CachedAnswer
from producer.wire.workers import QueueServing
from tests.image_inputs import chat, data_url, image, jpeg, openai_chat, png, png_claiming, sha, text
from worker.queue.cached_results import key_of

ROOT = Path(__file__).resolve().parents[2]
PHOTO, OTHER = png(), jpeg()
FP = "ab" * 32


def write(path: Path, *lines: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


async def serve(redis: Redis, **fields: Any) -> None:
    """What a worker of the default queue publishes (worker/service.py publish_serving)."""
    serving = QueueServing(model="vlm", fingerprint=FP, max_model_len=4096, **fields)
    await redis.set(keys.queue_serving(keys.DEFAULT_QUEUE), serving.model_dump_json())


async def submit(redis: Redis, path: Path, **kw: Any) -> Any:
    return await BatchqClient(redis).submit_file(path, **kw)  # (not closed: the fixture's client)


async def queued(redis: Redis, batch_id: str, index: int) -> Request:
    raw = await redis.get(job_key_prefix + keys.job_id(batch_id, index))
    assert raw is not None
    return Request.model_validate(orjson.loads(raw)["a"][0])


async def image_keys(redis: Redis) -> dict[str, bytes]:
    return {k.decode(): await redis.get(k) for k in await redis.keys(keys.image("*"))}


async def test_one_photo_asked_four_questions_is_stored_once_and_the_requests_refer_to_it(
    redis: Redis, tmp_path: Path
) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.png").write_bytes(PHOTO)
    (tmp_path / "other.jpg").write_bytes(OTHER)
    path = write(
        tmp_path / "in.jsonl",
        chat("q1", text("What animal?"), image(data_url(PHOTO), detail="auto")),
        chat("q2", image("file://photos/cat.png"), text("What colour?")),
        chat("q3", image("file://./photos/../photos/cat.png"), text("How many?")),
        openai_chat("q4", text("Compare"), image(data_url(PHOTO)), image(f"file://{tmp_path}/other.jpg")),
    )
    report = await submit(redis, path, batch_id="b1", result_ttl_s=3600)
    assert (report.enqueued, report.invalid) == (4, 0)
    assert await image_keys(redis) == {keys.image(sha(PHOTO)): PHOTO, keys.image(sha(OTHER)): OTHER}
    assert 3500 < await redis.ttl(keys.image(sha(PHOTO))) <= 3600

    first, fourth = await queued(redis, "b1", 0), await queued(redis, "b1", 3)
    assert first.messages is not None and fourth.messages is not None
    assert first.messages[0].model_dump(exclude_none=True)["content"] == [
        {"type": "text", "text": "What animal?"},
        {"type": "image_url", "image_url": {"url": image_ref(sha(PHOTO))}},  # "detail" dropped
    ]
    assert [p.image_url.url for p in fourth.messages[0].content[1:]] == [  # type: ignore[union-attr]
        image_ref(sha(PHOTO)), image_ref(sha(OTHER)),
    ]  # fmt: skip


async def test_submit_looks_an_image_request_up_under_the_key_the_worker_stores_it_by(
    redis: Redis, tmp_path: Path
) -> None:
    """The same line twice: the worker's key (key_of, from the queued request) answers the second submit
    from the result cache, so the two sides key image requests alike; another image is another key."""
    await serve(redis, images=True)
    system = {"role": "system", "content": [text("Be brief."), text("One word.")]}  # joined, as the wire does
    line = chat("a", text("What animal?"), image(data_url(PHOTO)), temperature=0)
    line["messages"].insert(0, system)
    await submit(redis, write(tmp_path / "a.jsonl", line), batch_id="b1")
    key = key_of(FP, await queued(redis, "b1", 0))
    assert key is not None
    await redis.set(key, CachedAnswer(text="cat", finish_reason="eos", prompt_tokens=9, completion_tokens=1,
                                      model="vlm").to_json())  # fmt: skip
    again = await submit(redis, write(tmp_path / "b.jsonl", line), batch_id="b2")
    assert (again.cached, again.enqueued) == (1, 0)
    line["messages"][1]["content"][1] = image(data_url(png(color="green")))
    other = await submit(redis, write(tmp_path / "c.jsonl", line), batch_id="b3")
    assert (other.cached, other.enqueued) == (0, 1)


async def test_an_image_stored_again_is_kept_for_the_longest_ttl_that_needs_it(
    redis: Redis, tmp_path: Path
) -> None:
    path = write(tmp_path / "in.jsonl", chat("a", image(data_url(PHOTO))))
    await submit(redis, path, batch_id="short", result_ttl_s=100)
    await submit(redis, path, batch_id="long", result_ttl_s=5000)
    assert 4900 < await redis.ttl(keys.image(sha(PHOTO))) <= 5000
    await submit(redis, path, batch_id="shorter", result_ttl_s=10)
    assert 4900 < await redis.ttl(keys.image(sha(PHOTO))) <= 5000
    assert len(await image_keys(redis)) == 1


URL = "body.messages.0.content.1.image_url.url"  # the image part of an openai_chat(text, image) line


@pytest.mark.parametrize(
    ("part", "serving", "limits", "reason"),
    [
        (image(data_url(b"not an image")), None, None, "not a decodable image (cannot identify image file)"),
        (image(data_url(PHOTO, "text/plain")), None, None, "a data: URL of type 'text/plain', not an image"),
        (image("data:image/png;base64,@@@"), None, None, "invalid base64 in the data: URL"),
        (image(data_url(PHOTO)), None, ImageLimits(bytes=50),
         f"the image is {len(PHOTO)} bytes, over the limit of 50 bytes"),
        (image(data_url(png_claiming(8000, 8000))), None, None,
         "the image is 8000x8000 = 64,000,000 pixels, over the limit of 50,000,000 pixels"),
        (image(data_url(png_claiming(30000, 30000))), None, None,
         "the image has more pixels than the limit of 50,000,000 (a decompression bomb?)"),
        (image(data_url(PHOTO)), {"images": False}, None,
         "the model 'vlm' serving this queue takes no images (text only)"),
        (image("https://example.com/cat.png"), None, None,
         "http(s) image URLs are not fetched by this queue's workers"),
        (image("https://example.com/cat.png"), {"images": True}, None,
         "http(s) image URLs are not fetched by this queue's workers"),
        (image(image_ref(sha(PHOTO))), None, None, "batchq-image:// references are written by submit"),
        (image("ftp://example.com/cat.png"), None, None, "unsupported image URL 'ftp'"),
        (image("file://../outside.png"), None, None, "'../outside.png' resolves to "),
        (image("file://link.png"), None, None, "'link.png' resolves to "),
        (image("file://missing.png"), None, None, "no such file: "),
    ],
)  # fmt: skip
async def test_an_image_that_cannot_run_is_refused_by_line_and_field_and_nothing_is_enqueued(
    redis: Redis,
    tmp_path: Path,
    part: dict[str, Any],
    serving: dict[str, Any] | None,
    limits: ImageLimits | None,
    reason: str,
) -> None:
    folder = tmp_path / "batch"
    (tmp_path / "outside.png").write_bytes(PHOTO)
    folder.mkdir()
    (folder / "link.png").symlink_to(tmp_path / "outside.png")  # a symlink out of the folder is outside it
    path = write(
        folder / "in.jsonl", openai_chat("ok", text("fine")), openai_chat("bad", text("what?"), part)
    )
    if serving is not None:
        await serve(redis, **serving)
    with pytest.raises(InputError) as e:
        await submit(redis, path, image_limits=limits)
    (err,) = e.value.errors
    assert (err.line_no, err.field, err.id) == (2, URL, "bad") and err.reason.startswith(reason), err
    assert await redis.keys("*") == ([keys.queue_serving(keys.DEFAULT_QUEUE).encode()] if serving else [])


async def test_too_many_images_in_one_request_are_refused_naming_the_messages(redis: Redis) -> None:
    line = chat("many", *[image(data_url(png(color=c))) for c in ["red"] * 5 + ["blue"] * 4])
    with pytest.raises(InputError) as e:
        await submit_stream(redis, io.BytesIO(orjson.dumps(line) + b"\n"))
    assert [str(x) for x in e.value.errors] == [
        "line 1: messages: 9 images in one request, more than the limit of 8"
    ]
    assert await redis.keys("*") == []


async def test_http_images_go_as_written_to_workers_that_fetch_them_and_are_never_cached(
    redis: Redis,
) -> None:
    await serve(redis, images=True, image_urls=True)
    url = "https://example.com/cat.png"
    line = chat("web", text("what?"), image(url), temperature=0)
    report = await submit_stream(redis, io.BytesIO(orjson.dumps(line) + b"\n"), batch_id="b1")
    assert report.enqueued == 1 and await image_keys(redis) == {}
    req = await queued(redis, "b1", 0)
    assert req.messages[0].content[1].image_url.url == url  # type: ignore[index, union-attr]
    assert key_of(FP, req) is None


def producer(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`producer` as a user runs it, on this checkout's code (cwd: a folder the paths are not relative to)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "producer.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def test_producer_submit_lists_every_bad_image_by_line_and_field_and_enqueues_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "batch"
    (folder / "img").mkdir(parents=True)
    (folder / "img" / "cat.png").write_bytes(PHOTO)
    bad = write(
        folder / "bad.jsonl",
        chat("ok", text("what?"), image("file://img/cat.png")),
        chat("two", image("file://img/cat.png"), image(data_url(OTHER, "image/jpeg"))),
        chat("big", image(data_url(png(64, 64)))),
        chat("away", image("file:///etc/passwd")),
    )
    out = producer("submit", str(bad), "--redis-url", redis_url, "--max-images-per-request", "1",
                   "--max-image-pixels", "1000", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: {bad}: 3 invalid line(s); nothing was enqueued",
        "  line 2: messages: 2 images in one request, more than the limit of 1",
        "  line 3: messages.0.content.0.image_url.url: the image is 64x64 = 4,096 pixels, over the limit of "
        "1,000 pixels",
        f"  line 4: messages.0.content.0.image_url.url: '/etc/passwd' resolves to /etc/passwd, outside "
        f"the JSONL file's folder {folder.resolve()}",
    ]

    good = write(folder / "good.jsonl", chat("ok", text("what?"), image("file://img/cat.png")))
    out = producer("submit", str(good), "--redis-url", redis_url, "--batch-id", "b1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    import redis as sync_redis

    r = sync_redis.Redis.from_url(redis_url)
    try:
        assert r.keys(keys.image("*")) == [keys.image(sha(PHOTO)).encode()]
        assert r.zcard(keys.DEFAULT_QUEUE) == 1
    finally:
        r.close()


async def test_an_image_part_spelt_with_unicode_escapes_is_still_an_image(redis: Redis) -> None:
    # (submit looks for the bytes "image_url" before it walks a chat line's messages)
    line = orjson.dumps(chat("e", image(data_url(PHOTO)))).replace(b'"image_url"', b'"\\u0069mage_url"')
    assert b"image_url" not in line
    await submit_stream(redis, io.BytesIO(line + b"\n"), batch_id="b1")
    assert await image_keys(redis) == {keys.image(sha(PHOTO)): PHOTO}
    assert (await queued(redis, "b1", 0)).messages[0].content[0].image_url.url == image_ref(sha(PHOTO))  # type: ignore[index, union-attr]


def test_make_runs_check_resolves_file_images_in_the_files_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from producer.cli.check import check_file

    (tmp_path / "cat.png").write_bytes(PHOTO)
    good = write(tmp_path / "good.jsonl", chat("a", image("file://cat.png")))
    assert check_file(str(good)) == 0
    bad = write(tmp_path / "bad.jsonl", chat("a", image("file://dog.png")))
    assert check_file(str(bad)) == 2
    assert f"line 1: messages.0.content.0.image_url.url: no such file: {tmp_path.resolve()}/dog.png" in (
        capsys.readouterr().err
    )


async def test_a_retry_keeps_the_images_again_and_skips_a_request_whose_image_expired(
    redis: Redis, tmp_path: Path
) -> None:
    """`producer retry` enqueues a failed image request again only while its images are stored, and keeps
    them for the batch's result TTL again; one whose image expired would fail again: not retryable."""
    from producer.client.retry import retry_batch
    from producer.wire import store
    from producer.wire.results import ErrorInfo, Result

    path = write(tmp_path / "in.jsonl", chat("kept", image(data_url(PHOTO)), text("?")),
                 chat("gone", image(data_url(OTHER)), text("?")))  # fmt: skip
    await submit(redis, path, batch_id="b1", result_ttl_s=3600)
    for index in (0, 1):  # both failed: a worker wrote errors, keeping their requests for a retry
        req = await queued(redis, "b1", index)
        err = Result(
            id=req.id, index=index, finish_reason="error", error=ErrorInfo(type="engine_error", message="x")
        )
        raw = orjson.dumps(req.model_dump(mode="json", exclude_none=True))
        assert await store.write_result(redis, "b1", err, request=raw)
    await redis.expire(keys.image(sha(PHOTO)), 60)  # nearly gone: the retry keeps it for the batch's TTL
    await redis.delete(keys.image(sha(OTHER)))  # gone
    report = await retry_batch(redis, "b1", frozenset({"error"}))
    assert (report.selected, report.enqueued, report.not_retryable) == (2, 1, 1)
    assert 3500 < await redis.ttl(keys.image(sha(PHOTO))) <= 3600


async def test_a_detail_other_than_auto_is_refused_by_name(redis: Redis, tmp_path: Path) -> None:
    path = write(
        tmp_path / "in.jsonl", openai_chat("hi", text("what?"), image(data_url(PHOTO), detail="high"))
    )
    with pytest.raises(InputError) as e:
        await submit(redis, path)
    (err,) = e.value.errors
    assert err.line_no == 1 and err.field.endswith("image_url.detail"), err
    assert "detail 'high' is unsupported" in err.reason and "'auto'" in err.reason
    assert await redis.keys("*") == []
