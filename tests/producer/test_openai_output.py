"""`producer results --format openai [--errors FILE]` read back with the openai package's own pydantic types,
on results a real worker wrote: success, failure and cancellation lines keep OpenAI's exact shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import BaseModel
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from producer.client.batchq_client import BatchqClient
from tests.worker.conftest import ROOT

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Say hi"}]
LINES = [
    {"id": "chat", "messages": CHAT, "max_new_tokens": 5, "temperature": 0},
    {"id": "text", "prompt": "Once upon a time", "max_new_tokens": 5, "temperature": 0, "logprobs": True,
     "top_logprobs": 1},
    {"custom_id": "oa", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}},
    {"id": "long-chat", "messages": [{"role": "user", "content": "word " * 3000}], "max_new_tokens": 4},
    {"id": "long-text", "prompt": "word " * 3000, "max_new_tokens": 4},
]  # fmt: skip
LINE_KEYS = {"id", "custom_id", "response", "error"}


def exact(model: type[BaseModel], obj: dict[str, Any]) -> BaseModel:
    """Parse `obj` as `model` and insist that nothing in it, at any depth, is a field the type lacks."""
    parsed = model.model_validate(obj)

    def walk(m: Any) -> None:
        if isinstance(m, BaseModel):
            assert not m.model_extra, f"{type(m).__name__} has no field(s) {sorted(m.model_extra)}"
            for name in type(m).model_fields:
                walk(getattr(m, name))
        elif isinstance(m, list):
            for x in m:
                walk(x)

    walk(parsed)
    return parsed


def results(url: str, bid: str, *args: str) -> bytes:
    cmd = [
        sys.executable,
        "-m",
        "producer.cli",
        "results",
        bid,
        "--format",
        "openai",
        "--redis-url",
        url,
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, cwd=ROOT, check=False, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout


async def test_output_and_error_files_parse_as_openai_types(shared_worker, tmp_path: Path) -> None:
    server, _worker = shared_worker
    async with BatchqClient.from_url(server.url) as c:
        bid = (await c.submit_lines([orjson.dumps(x) for x in LINES])).batch_id
        await c.wait(bid, timeout=60)
        parked = (await c.submit_lines([b'{"id": "p", "prompt": "never run"}'], queue="parked")).batch_id
        assert await c.cancel(parked) == 1  # no worker serves that queue: cancelled while queued
        mine = {r.id: r async for r in c.results(bid)}

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert results(server.url, bid, "-o", str(out), "--errors", str(err)) == b""
    ok = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    bad = [orjson.loads(x) for x in err.read_bytes().splitlines()]
    assert [x["custom_id"] for x in ok] == ["chat", "text", "oa"]
    assert [x["custom_id"] for x in bad] == ["long-chat", "long-text"]
    for x in ok:
        assert set(x) == LINE_KEYS and x["error"] is None
        response = x["response"]
        assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
        body = exact(Completion if x["custom_id"] == "text" else ChatCompletion, response["body"])
        r = mine[x["custom_id"]]
        assert body.usage is not None and body.usage.completion_tokens == r.usage.completion_tokens
        if isinstance(body, ChatCompletion):
            assert body.object == "chat.completion" and body.choices[0].message.content == r.text
        else:
            assert isinstance(body, Completion) and body.object == "text_completion"
            assert body.choices[0].text == r.text and body.choices[0].logprobs is not None
    oa = ok[2]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(oa) == 3 and all(len(t["top_logprobs"]) == 2 for t in oa)
    for x, param in zip(bad, ("messages", "prompt"), strict=True):
        assert set(x) == LINE_KEYS and x["error"] is None
        response = x["response"]
        assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 400
        assert set(response["body"]) == {"error"}
        e = exact(ErrorObject, response["body"]["error"])
        assert isinstance(e, ErrorObject)
        assert (e.type, e.param, e.code) == ("invalid_request_error", param, "prompt_too_long")
        assert set(response["body"]["error"]) == {"message", "type", "param", "code"}

    # Without --errors every line goes to one file, in input order.
    together = [orjson.loads(x) for x in results(server.url, bid).splitlines()]
    assert [x["custom_id"] for x in together] == [x.get("id") or x.get("custom_id") for x in LINES]

    (cancelled,) = [orjson.loads(x) for x in results(server.url, parked).splitlines()]
    assert set(cancelled) == LINE_KEYS and cancelled["response"] is None
    be = exact(BatchError, cancelled["error"])
    assert isinstance(be, BatchError) and be.code == "batch_cancelled" and be.message
