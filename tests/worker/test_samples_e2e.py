"""n > 1 end to end: `producer submit` -> a real worker process -> `producer results` (batchq JSONL and
OpenAI output read back with the openai package's types), a rerun answered from the result cache with
every sample, and bad n / best_of refused by file, line and field."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion

from tests.worker.conftest import ROOT, assert_consistent, results_count, wait_until, write_jsonl

pytestmark = pytest.mark.slow

LABELS = ["positive", "negative", "neutral"]


def cli(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args, "--redis-url", url],
                          capture_output=True, cwd=ROOT, check=False, timeout=120)  # fmt: skip


def submit(url: str, path: Path) -> dict[str, Any]:
    out = cli(url, "submit", str(path), "--json")
    assert out.returncode == 0, out.stderr.decode()
    return dict(orjson.loads(out.stdout))


def results(url: str, bid: str, *args: str) -> list[dict[str, Any]]:
    out = cli(url, "results", bid, *args)
    assert out.returncode == 0, out.stderr.decode()
    return [orjson.loads(x) for x in out.stdout.splitlines()]


def test_samples_run_return_as_choices_and_a_rerun_is_answered_with_all_of_them(
    shared_worker: Any, tmp_path: Path
) -> None:
    server, _worker = shared_worker
    tag = uuid.uuid4().hex[:8]  # prompts of this test alone: nothing cached before it
    lines: list[dict[str, Any]] = [
        {"id": "story", "prompt": f"Once upon a time {tag}", "max_new_tokens": 8, "temperature": 0.9, "seed": 4,
         "n": 3},
        {"id": "label", "prompt": f"Review {tag}: great film. Sentiment:", "choices": LABELS, "temperature": 2.0,
         "seed": 1, "n": 7},
        {"id": "greedy", "prompt": f"Count {tag}: 1 2 3", "max_new_tokens": 5, "temperature": 0, "n": 2},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"Hi {tag}"}], "max_tokens": 6, "temperature": 0.8,
                  "seed": 2, "n": 2, "best_of": 3}},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    first = submit(server.url, path)
    assert first["cached"] == 0
    wait_until(lambda: results_count(server.url, first["batch_id"]) == len(lines), 120, "the first run")
    assert_consistent(server.url, first["batch_id"], len(lines))  # usage counters sum the results' usage
    got = {r["id"]: r for r in results(server.url, first["batch_id"])}
    assert [len(got[i]["choices"]) for i in ("story", "label", "greedy", "chat")] == [3, 7, 2, 2]
    for r in got.values():
        assert r["error"] is None and [c["index"] for c in r["choices"]] == list(range(len(r["choices"])))
        assert r["text"] == r["choices"][0]["text"]
    story = got["story"]
    assert story["usage"]["completion_tokens"] == sum(c["completion_tokens"] for c in story["choices"])
    assert len({c["text"] for c in story["choices"]}) > 1, "the samples share a seed stream"
    label = got["label"]
    assert list(label["vote"]) == LABELS and sum(label["vote"].values()) == 7
    assert label["agreement"] == max(label["vote"].values()) / 7
    assert len({c["text"] for c in got["greedy"]["choices"]}) == 1  # greedy samples agree

    again = submit(server.url, path)  # every line is determined (seeded or greedy): answered at submit
    assert (again["cached"], again["enqueued"]) == (len(lines), 0)
    wait_until(lambda: results_count(server.url, again["batch_id"]) == len(lines), 60, "the rerun")
    rerun = {r["id"]: r for r in results(server.url, again["batch_id"])}
    for rid, r in rerun.items():
        assert r["cached"] is True
        assert (r["choices"], r["usage"], r.get("vote")) == (
            got[rid]["choices"],
            got[rid]["usage"],
            got[rid].get("vote"),
        )

    (chat,) = [
        x for x in results(server.url, first["batch_id"], "--format", "openai") if x["custom_id"] == "chat"
    ]
    body = ChatCompletion.model_validate(chat["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1]
    assert [c.message.content for c in body.choices] == [c["text"] for c in got["chat"]["choices"]]
    assert body.usage is not None and body.usage.prompt_tokens == got["chat"]["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ({"prompt": "x", "n": 0}, "line 1: n: Input should be greater than or equal to 1"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "line 1: best_of: best_of must be >= n: best_of is 2, n is 3"),
        ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "n": 2, "best_of": 1}},
         "line 1: body.best_of: best_of must be >= n: best_of is 1, n is 2"),
    ],
)  # fmt: skip
def test_bad_n_or_best_of_is_refused_by_file_line_and_field(
    shared_worker: Any, tmp_path: Path, line: dict[str, Any], error: str
) -> None:
    server, _worker = shared_worker
    path = write_jsonl(tmp_path / "bad.jsonl", [line])
    out = cli(server.url, "submit", str(path))
    assert out.returncode == 2
    err = out.stderr.decode().splitlines()
    assert err[0] == f"error: {path}: 1 invalid line(s); nothing was enqueued" and err[1] == f"  {error}"
