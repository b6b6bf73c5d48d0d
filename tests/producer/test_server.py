"""`producer serve` end to end: the official openai client against a real server process, a real Redis and a
real worker process (a tiny random Llama), as a team's nightly batch code would run it.

One Redis, one worker and two server instances (two keys in a keys file, one in $BATCHQ_API_KEYS) serve
the whole module; every test makes objects of its own (unique prompts, so the result cache answers none).
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from openai.types import Batch, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from producer.api.auth import owner_id
from producer.api.batch_object import BatchRecord
from producer.wire import keys
from tests.tiny_models import build_tiny_checkpoint
from tests.worker.conftest import ROOT, Worker, batch_state
from worker.embedded_redis import RedisServer, free_port

pytestmark = pytest.mark.slow

KEY_A, KEY_B, KEY_C = (f"sk-test-{name}-{uuid.uuid4().hex}" for name in ("alice", "bob", "carol"))
TERMINAL = ("completed", "failed", "expired", "cancelled")
MAX_UPLOAD_MB = 64


class ApiServer:
    """A `producer serve` process on a fixed port (restartable there), its log in a file."""

    def __init__(self, redis_url: str, keys_file: Path, log_dir: Path, name: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"server-{name}.log"
        self.cmd = [sys.executable, "-m", "producer.cli", "serve", "--port", str(self.port), "--redis-url",
                    redis_url, "--api-keys-file", str(keys_file), "--max-upload-mb", str(MAX_UPLOAD_MB),
                    *args]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ApiServer:
        env = {**os.environ, "BATCHQ_API_KEYS": KEY_C}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        return self

    def wait_ready(self, timeout: float = 60.0) -> ApiServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"server exited:\n{self.log()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def peak_rss_kb(self) -> int:
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Redis, a worker on a tiny random model and two server instances, all starting side by side."""
    tmp = tmp_path_factory.mktemp("api")
    model = build_tiny_checkpoint(tmp / "tiny", "llama", max_position_embeddings=1024)
    store = RedisServer(appendonly=False).start()
    keys_file = tmp / "api-keys"  # two keys here, the third in $BATCHQ_API_KEYS
    keys_file.write_text(f"# team keys\n{KEY_A}\n\n{KEY_B}\n")
    worker = Worker(store.url, str(model), tmp, "api", "--max-num-seqs", "4", "--dtype", "float32",
                    "--repetition-repeats", "0")  # fmt: skip
    alias = ("--model-alias", f"tiny={model}")  # the lines' body.model names the worker's model so
    server = ApiServer(store.url, keys_file, tmp, "a", *alias).start()
    other = ApiServer(store.url, keys_file, tmp, "b", *alias).start()  # a second instance, same Redis
    try:
        server.wait_ready()
        other.wait_ready()
        worker.wait_ready()
        yield {
            "redis": store,
            "server": server,
            "other": other,
            "worker": worker,
            "tmp": tmp,
            "model": str(model),
        }
    finally:
        server.kill()
        other.kill()
        worker.stop()
        store.close()


def client(stack: dict[str, Any], key: str = KEY_A, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["server"].url, api_key=key, **kw)


def chat_line(cid: str, content: str, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


def wait_done(c: openai.OpenAI, batch_id: str, timeout: float = 60.0) -> Batch:
    deadline = time.monotonic() + timeout
    while (b := c.batches.retrieve(batch_id)).status not in TERMINAL:
        assert time.monotonic() < deadline, f"batch still {b.status} after {timeout}s: {b.request_counts}"
        time.sleep(0.2)
    return b


def output_lines(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [orjson.loads(x) for x in c.files.content(file_id).read().splitlines()]


def one_line_batch(c: openai.OpenAI, tag: str) -> Batch:
    f = c.files.create(
        file=("one.jsonl", jsonl([chat_line("only", f"hi {tag}", temperature=0)])), purpose="batch"
    )
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_the_sync_client_uploads_runs_a_chat_batch_and_downloads_output_and_error_files(stack):
    tag = uuid.uuid4().hex
    lines = [chat_line(f"q{i}", f"question {i} {tag}", temperature=0) for i in range(5)]
    lines.insert(2, chat_line("too-long", "x" * 3000))  # beyond the model's 1024 positions: fails alone
    data = jsonl(lines)
    with client(stack) as c:
        f = c.files.create(
            file=("nightly.jsonl", data),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        assert (f.object, f.purpose, f.filename, f.status) == ("file", "batch", "nightly.jsonl", "processed")
        assert f.bytes == len(data) and f.expires_at == f.created_at + 3600
        assert c.files.retrieve(f.id) == f
        assert c.files.content(f.id).read() == data

        meta = {"job": "nightly"}
        b = c.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=meta,
            output_expires_after={"anchor": "created_at", "seconds": 7200},
        )
        assert b.status in ("in_progress", "finalizing", "completed") and b.input_file_id == f.id
        b = wait_done(c, b.id)
        assert b.status == "completed", b
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (6, 5, 1)
        assert b.metadata == meta and b.endpoint == "/v1/chat/completions"
        assert b.model == stack["model"]  # the model that ran ("tiny" maps to it: --model-alias)
        assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at
        assert b.usage is not None and b.usage.output_tokens > 0

        stored = batch_state(stack["redis"].url, b.id)["results"]  # what the worker wrote, read from Redis
        out = output_lines(c, b.output_file_id)
        assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(5)]  # input order
        for x in out:
            body = ChatCompletion.model_validate(x["response"]["body"])
            assert x["response"]["status_code"] == 200 and x["error"] is None
            mine = next(r for r in stored.values() if r["id"] == x["custom_id"])
            assert body.choices[0].message.content == mine["text"]
            assert body.usage is not None
            assert body.usage.completion_tokens == mine["usage"]["completion_tokens"]
            assert body.model == stack["model"]
        (err,) = output_lines(c, b.error_file_id)
        assert err["custom_id"] == "too-long" and err["error"] is None
        assert err["response"]["status_code"] == 400
        assert err["response"]["body"]["error"]["code"] == "prompt_too_long"

        out_file = c.files.retrieve(b.output_file_id)
        assert out_file.purpose == "batch_output" and out_file.expires_at == out_file.created_at + 7200
        assert out_file.bytes == len(c.files.content(out_file.id).read())
        assert c.batches.retrieve(b.id) == b  # ended: the object no longer moves
        assert c.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(f.id)


async def test_the_async_client_runs_a_completions_batch(stack):
    tag = uuid.uuid4().hex
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": f"Once {i} {tag}", "max_tokens": 6, "temperature": 0}}
        for i in range(4)
    ]  # fmt: skip
    async with openai.AsyncOpenAI(base_url=stack["server"].url, api_key=KEY_B) as c:
        f = await c.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while b.status not in TERMINAL and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            b = await c.batches.retrieve(b.id)
        assert b.status == "completed" and b.error_file_id is None
        out = [orjson.loads(x) for x in (await c.files.content(b.output_file_id)).read().splitlines()]
        assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(4)]
        for x in out:
            body = Completion.model_validate(x["response"]["body"])
            assert body.object == "text_completion" and body.choices[0].finish_reason in ("stop", "length")
            assert body.usage is not None and 1 <= body.usage.completion_tokens <= 6


def test_an_embeddings_batch_runs_and_its_output_is_openais_embedding_lists(stack):
    tag = uuid.uuid4().hex
    lines = [
        {"custom_id": "f", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "tiny", "input": [f"first {tag}", f"second {tag}"], "dimensions": 8}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "tiny", "input": f"first {tag}", "dimensions": 8, "encoding_format": "base64"}},
    ]  # fmt: skip
    with client(stack) as c:
        f = c.files.create(file=("emb.jsonl", jsonl(lines)), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="holds 2 /v1/embeddings request"):
            c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = wait_done(
            c, c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id
        )
        assert b.status == "completed" and b.endpoint == "/v1/embeddings" and b.error_file_id is None
        assert (b.request_counts.total, b.request_counts.completed) == (2, 2)
        out = {x["custom_id"]: x for x in output_lines(c, b.output_file_id)}
        floats = CreateEmbeddingResponse.model_validate(out["f"]["response"]["body"])
        assert [d.index for d in floats.data] == [0, 1] and all(len(d.embedding) == 8 for d in floats.data)
        assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
        assert floats.model == stack["model"]
        (encoded,) = out["b"]["response"]["body"]["data"]
        packed = base64.b64decode(encoded["embedding"])
        assert struct.unpack("<8f", packed) == pytest.approx(floats.data[0].embedding, abs=1e-7)


def test_a_bad_file_is_refused_with_line_numbers_and_nothing_is_stored(stack):
    good = orjson.dumps(chat_line("ok", "fine"))
    bad = b"\n".join([
        good,
        b'{"custom_id": "j", "method": "POST", "url": "/v1/chat/completions", "body": {',
        orjson.dumps(chat_line("t", "x", temperature="hot")),
        orjson.dumps(chat_line("f", "x", tools=[{"type": "function"}])),
        b"",
    ])  # fmt: skip
    with client(stack, KEY_B) as c:
        before = len(c.files.list().data)
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("bad.jsonl", bad), purpose="batch")
        err = e.value.body
        assert isinstance(err, dict) and err["type"] == "invalid_request_error" and err["param"] == "file"
        assert "3 invalid line(s)" in err["message"]
        assert "line 2: invalid JSON" in err["message"]
        assert "line 3: body.temperature" in err["message"]
        assert "line 4: body: 'tools' is unsupported" in err["message"]
        assert len(c.files.list().data) == before

        prompt_line = {"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}
        completions = c.files.create(file=("p.jsonl", jsonl([prompt_line])), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="1 /v1/completions request"):
            c.batches.create(
                input_file_id=completions.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="unsupported") as e:
            c.batches.create(input_file_id=completions.id, endpoint="/v1/responses", completion_window="24h")
        assert isinstance(e.value.body, dict) and e.value.body["param"] == "endpoint"
        with pytest.raises(openai.BadRequestError, match="holds 1 /v1/completions request") as e:
            c.batches.create(input_file_id=completions.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: priority"):
            c.batches.create(input_file_id=completions.id, endpoint="/v1/completions", completion_window="24h",
                             extra_body={"priority": "high"})  # fmt: skip


def test_a_line_for_a_model_no_worker_serves_gets_a_404_and_the_rest_run(stack):
    """`"model": "gpt-4o-mini"` with no alias for it: that line fails with model_not_found (never run on
    the worker's model and echoed as gpt-4o-mini); the lines for the served model complete."""
    tag = uuid.uuid4().hex
    lines = [
        chat_line("ok", f"fine {tag}", temperature=0),
        chat_line("other", f"x {tag}", model="gpt-4o-mini"),
    ]
    with client(stack) as c:
        f = c.files.create(file=("m.jsonl", jsonl(lines)), purpose="batch")
        b = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)  # fmt: skip
        assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 1, 1)
        (ok,) = output_lines(c, b.output_file_id)
        assert ok["custom_id"] == "ok" and ok["response"]["body"]["model"] == stack["model"]
        (err,) = output_lines(c, b.error_file_id)
        assert err["custom_id"] == "other" and err["response"]["status_code"] == 404
        e = err["response"]["body"]["error"]
        assert (e["type"], e["code"], e["param"]) == ("invalid_request_error", "model_not_found", "model")
        assert "gpt-4o-mini" in e["message"] and "--model-alias gpt-4o-mini=" in e["message"]


def test_an_uncompilable_schema_or_regex_is_a_400_naming_line_and_field(stack):
    lines = [
        chat_line("r", "x", regex="[a-z]+"),
        chat_line("bad-regex", "x", regex="a("),
        chat_line("bad-schema", "x", response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
    ]  # fmt: skip
    with client(stack) as c, pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("g.jsonl", jsonl(lines)), purpose="batch")
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "invalid_request_error"
    assert "line 2: body.regex: cannot compile the regex: unclosed group" in err["message"]
    assert "line 3: body.response_format.json_schema.schema: cannot compile the JSON Schema" in err["message"]
    assert "\n   " not in err["message"] and "^" not in err["message"]  # no Rust source diagram


def test_reasoning_fields_are_accepted_on_chat_lines_and_refused_by_line_and_field_elsewhere(stack):
    """chat_template_kwargs, reasoning_effort and max_reasoning_tokens run on a chat line (the tiny Llama has
    no think tokens: no reasoning_content, reasoning_tokens 0); a completions line naming them is a 400."""
    tag = uuid.uuid4().hex
    reasoning = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
                 "max_reasoning_tokens": 4}  # fmt: skip
    with client(stack) as c:
        f = c.files.create(file=("r.jsonl", jsonl([chat_line("r", f"think {tag}", temperature=0, **reasoning)])),
                           purpose="batch")  # fmt: skip
        b = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)  # fmt: skip
        (line,) = output_lines(c, b.output_file_id)
        body = line["response"]["body"]
        assert "reasoning_content" not in body["choices"][0]["message"]
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        ChatCompletion.model_validate(body)
        text_line = {"custom_id": "p", "method": "POST", "url": "/v1/completions",
                     "body": {"model": "tiny", "prompt": "a", "reasoning_effort": "low"}}  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("p.jsonl", jsonl([text_line])), purpose="batch")
        err = e.value.body
        assert isinstance(err, dict)
        assert "line 1: body.reasoning_effort: applies to chat requests (messages) only" in err["message"]


def test_a_key_sees_only_its_own_files_and_batches_and_keys_never_reach_the_log(stack):
    with client(stack, KEY_A) as a, client(stack, KEY_B) as b:
        batch = one_line_batch(a, uuid.uuid4().hex)
        with pytest.raises(openai.NotFoundError) as e:
            b.batches.retrieve(batch.id)
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "not_found"
        for call in (
            lambda: b.batches.cancel(batch.id),
            lambda: b.files.retrieve(batch.input_file_id),
            lambda: b.files.content(batch.input_file_id),
            lambda: b.files.delete(batch.input_file_id),
            lambda: b.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h"),
        ):  # fmt: skip
            with pytest.raises(openai.NotFoundError):
                call()
        assert batch.id not in {x.id for x in b.batches.list(limit=100)}
        assert wait_done(a, batch.id).status == "completed"  # and the owner still sees it whole

        for bad in (client(stack, "sk-wrong"), client(stack, KEY_A + "x"), client(stack, KEY_A[:-1])):
            with bad, pytest.raises(openai.AuthenticationError) as e:
                bad.batches.retrieve(batch.id)
            assert isinstance(e.value.body, dict) and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError, match="Missing bearer"):
            a.batches.list(extra_headers={"Authorization": openai.Omit()})  # no Authorization header at all
    log = stack["server"].log()
    assert "401" in log and batch.id in log  # the access log is on
    assert all(k not in log for k in (KEY_A, KEY_B, KEY_C))


def test_list_pages_newest_first_with_after_and_limit(stack):
    with client(stack, KEY_C) as c:  # the $BATCHQ_API_KEYS key: a list of this test's batches only
        ids = [one_line_batch(c, uuid.uuid4().hex).id for _ in range(3)][::-1]
        raw = c.batches.with_raw_response.list(limit=2).http_response.json()
        assert [x["id"] for x in raw["data"]] == ids[:2]
        assert raw["object"] == "list" and raw["has_more"] is True
        assert (raw["first_id"], raw["last_id"]) == (ids[0], ids[1])
        page = c.batches.list(limit=2, after=ids[1])
        assert [x.id for x in page.data] == ids[2:] and page.has_more is False
        assert [x.id for x in c.batches.list(limit=2)] == ids  # the SDK's auto-pagination follows `after`
        with pytest.raises(openai.BadRequestError):
            c.batches.list(limit=1000)


def test_cancel_mid_batch_keeps_what_finished_and_reports_the_rest_as_errors(stack):
    tag = uuid.uuid4().hex
    lines = [chat_line(f"r{i}", f"long {i} {tag}", max_tokens=30, ignore_eos=True) for i in range(40)]
    with client(stack) as c:
        f = c.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while (b := c.batches.retrieve(b.id)).request_counts.completed < 1:
            assert time.monotonic() < deadline and b.status == "in_progress", b
            time.sleep(0.1)
        cancelled = c.batches.cancel(b.id)
        assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at is not None
        b = wait_done(c, b.id)
        assert b.status == "cancelled" and b.cancelled_at is not None, b
        done = b.request_counts.completed
        assert 1 <= done < 40 and b.request_counts.failed == 0
        out = output_lines(c, b.output_file_id)
        errors = output_lines(c, b.error_file_id)
        assert len(out) == done and len(out) + len(errors) == 40
        assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 30 for x in out)
        with pytest.raises(openai.BadRequestError, match="cancelled"):
            c.batches.cancel(b.id)


def test_a_server_killed_mid_batch_loses_nothing_and_any_instance_serves_it(stack):
    tag = uuid.uuid4().hex
    lines = [chat_line(f"r{i}", f"restart {i} {tag}", max_tokens=40, ignore_eos=True) for i in range(8)]
    server: ApiServer = stack["server"]
    with client(stack) as c:
        f = c.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        server.kill()  # SIGKILL, mid-batch: no shutdown of any kind
        assert len(batch_state(stack["redis"].url, b.id)["results"]) < 8  # the worker is still at it
        with client(stack, max_retries=0) as down, pytest.raises(openai.APIConnectionError):
            down.batches.retrieve(b.id)
        with openai.OpenAI(base_url=stack["other"].url, api_key=KEY_A) as c2:  # the other instance
            assert c2.batches.retrieve(b.id).status in ("in_progress", "finalizing", "completed")
        server.start().wait_ready()
        b = wait_done(c, b.id)  # the same client, on the restarted server
        assert b.status == "completed" and b.request_counts.completed == 8
        out = output_lines(c, b.output_file_id)
        assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(8)]
        assert c.files.content(f.id).read() == jsonl(lines)


def test_a_100k_line_upload_streams_through_in_bounded_memory(stack):
    line = orjson.dumps(chat_line("x", "The quick brown fox jumps over the lazy dog. " * 8, temperature=0))
    data = b"".join(line.replace(b'"x"', b'"id-%d"' % i, 1) + b"\n" for i in range(100_000))
    server: ApiServer = stack["server"]
    before = server.peak_rss_kb()
    with client(stack, KEY_B, timeout=120) as c:
        f = c.files.create(file=("big.jsonl", data), purpose="batch")
        assert f.bytes == len(data) > 50_000_000
        # Validation keeps every id (duplicate check: ~15 MB for 100,000), never the content: the server's
        # peak stays well under one copy of the file.
        grown_mb = (server.peak_rss_kb() - before) / 1024
        assert grown_mb < len(data) / 2**20 / 2, f"server peak RSS grew {grown_mb:.0f} MB"
        assert c.files.content(f.id).read() == data
        c.files.delete(f.id)


def test_bodies_over_the_limits_are_refused_with_413(stack):
    with client(stack, KEY_B, max_retries=0) as c:
        f = c.files.create(file=("one.jsonl", jsonl([chat_line("a", "b")])), purpose="batch")
        with pytest.raises(openai.APIStatusError) as e:
            c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             extra_body={"padding": "x" * (1 << 20)})  # fmt: skip
        assert e.value.status_code == 413
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("huge.jsonl", b"x" * (MAX_UPLOAD_MB << 20)), purpose="batch")
        assert e.value.status_code == 413
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "request_too_large"


def test_without_keys_the_server_refuses_to_start_unless_told_to_serve_an_open_api(stack):
    env = {k: v for k, v in os.environ.items() if k != "BATCHQ_API_KEYS"}
    port = str(free_port())
    cmd = [sys.executable, "-m", "producer.cli", "serve", "--port", port, "--redis-url", stack["redis"].url]
    refused = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env, timeout=60, check=False)
    assert refused.returncode == 2 and b"--allow-no-auth" in refused.stderr

    log_path = stack["tmp"] / "server-open.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--allow-no-auth"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
    try:
        deadline = time.monotonic() + 60
        while b"Uvicorn running" not in log_path.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert b"the API is OPEN" in log_path.read_bytes()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="anything") as c:
            assert c.batches.list().data == []  # open, and its own namespace: no key's batches show
    finally:
        proc.kill()
        proc.wait(30)


def test_reads_finish_a_submit_cut_short_by_a_crash_and_expire_an_overdue_batch(stack):
    """The states a crashed instance and the passing of time leave in Redis, then the next read."""
    r = redis.Redis.from_url(stack["redis"].url)
    tag = uuid.uuid4().hex
    with client(stack) as c, r:
        f = c.files.create(
            file=("s.jsonl", jsonl([chat_line(f"s{i}", f"{tag} {i}") for i in range(3)])), purpose="batch"
        )
        # An instance died inside POST /v1/batches: the record exists, nothing marks the submit done, and
        # its lock has lapsed. (Part of the lines may be enqueued: submit is idempotent by batch id.)
        now = int(time.time())
        rec = BatchRecord(id=f"batch_{tag}", owner=owner_id(KEY_A), endpoint="/v1/chat/completions",
                          input_file_id=f.id, completion_window="24h", created_at=now, expires_at=now + 86400, total=3)  # fmt: skip
        r.hset(keys.api_batch(rec.id), mapping=rec.to_hash())
        r.zadd(keys.api_owner_batches(rec.owner), {rec.id: now})
        assert c.batches.retrieve(rec.id).status == "validating"  # and this read resumes the submit
        b = wait_done(c, rec.id)
        assert b.status == "completed" and b.request_counts.completed == 3, b
        assert [x["custom_id"] for x in output_lines(c, b.output_file_id)] == ["s0", "s1", "s2"]

        lines = [chat_line(f"e{i}", f"{tag} expire {i}", max_tokens=30, ignore_eos=True) for i in range(40)]
        f = c.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
        r.hset(keys.api_batch(b.id), "expires_at", now - 1)  # its hour has passed
        b = wait_done(c, b.id)
        assert b.status == "expired" and b.expired_at is not None, b
        assert b.request_counts.completed < 40 and b.error_file_id is not None
        assert len(output_lines(c, b.error_file_id)) == 40 - b.request_counts.completed
