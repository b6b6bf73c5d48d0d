"""End to end: producer submit -> real worker processes -> producer results, on the real model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import redis

from producer.wire import keys
from tests.worker.conftest import ROOT, assert_consistent, results_count, submit, wait_until, write_jsonl

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "configs" / "examples" / "prompts.jsonl"


def test_two_workers_complete_a_batch_with_exact_usage_and_engine_identical_text(server, workers, tmp_path):
    from producer.wire.request_params import SamplingParams
    from worker.engine.engine import Engine
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig
    from worker.queue.adapter import generation_params

    lines = [orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines() if x.strip()]
    by_id = {x.get("id") or x.get("custom_id"): x for x in lines}
    wanted = [f"sent-00{i}" for i in range(1, 7)] + [f"topic-00{i}" for i in range(1, 5)]
    wanted += [f"gen-00{i}" for i in range(1, 5)]  # sentiment, topics, generation with stops
    chosen = [by_id[i] for i in wanted]
    for x in chosen:
        x.pop("seed", None)
        x["temperature"] = 0
    path = write_jsonl(tmp_path / "in.jsonl", chosen)
    args = ["--dtype", "float32", "--max-num-seqs", "4", "--prefetch", "2"]
    a = workers(server.url, "smollm2-135m", *args, name="a")
    b = workers(server.url, "smollm2-135m", *args, name="b")
    a.wait_ready(300)
    b.wait_ready(300)
    bid = submit(server.url, path)
    wait_until(lambda: results_count(server.url, bid) == len(chosen), 300, "all results")

    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "results", bid, "--redis-url", server.url],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    got = [orjson.loads(x) for x in out.stdout.splitlines()]
    assert [g["id"] for g in got] == [x.get("id") or x.get("custom_id") for x in chosen]
    stored = assert_consistent(server.url, bid, len(chosen))
    assert {r["worker"] for r in stored.values()} == {a.id, b.id}, "both workers should share the load"

    # The same requests straight through the engine, in one batch: identical greedy text and usage.
    engine = Engine.load(EngineConfig(model="smollm2-135m", device="cpu", dtype="float32"))
    reqs = []
    for i, x in enumerate(chosen):
        body = x.get("body", x)
        params = generation_params(SamplingParams.model_validate(
            {k: v for k, v in body.items() if k not in ("id", "messages", "prompt", "metadata", "model")}
        ).resolve())  # fmt: skip
        reqs.append(EngineRequest(request_id=str(i), params=params, prompt=body.get("prompt"),
                                  messages=body.get("messages")))  # fmt: skip
    direct = engine.generate(reqs)
    tok = engine.tokenizer
    for g, d, x in zip(got, direct, chosen, strict=True):
        assert g["text"] == d.text, g["id"]
        assert g["finish_reason"] == d.finish_reason, g["id"]
        body = x.get("body", x)
        if "messages" in body:
            templated = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            n_prompt = len(tok(templated, add_special_tokens=False)["input_ids"])
        else:
            n_prompt = len(tok(body["prompt"])["input_ids"])
        assert g["usage"]["prompt_tokens"] == n_prompt, g["id"]
        assert g["usage"]["completion_tokens"] == len(d.token_ids), g["id"]
        assert g["usage"]["total_tokens"] == n_prompt + len(d.token_ids)
        assert g["error"] is None


def test_over_long_prompt_fails_alone_and_cancel_stops_the_rest(server, workers, tiny_model_dir, tmp_path):
    # Same max_new_tokens as the rest, so the queue (longest generations first) hands "huge" out first.
    lines = [{"id": "huge", "prompt": "word " * 3000, "max_new_tokens": 300}]
    lines += [{"id": f"r{i}", "prompt": f"item {i}", "max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
              for i in range(15)]  # fmt: skip
    w = workers(
        server.url,
        str(tiny_model_dir),
        "--max-num-seqs",
        "2",
        "--prefetch",
        "1",
        "--repetition-repeats",
        "0",
        name="a",
    )
    w.wait_ready()
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_until(lambda: results_count(server.url, bid) >= 4, 120, "some results")
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "cancel", bid, "--redis-url", server.url],
        capture_output=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()
    wait_until(lambda: results_count(server.url, bid) == len(lines), 60, "every request to end")
    results = assert_consistent(server.url, bid, len(lines))
    assert results[0]["finish_reason"] == "error"
    assert results[0]["error"]["type"] == "prompt_too_long"
    reasons = [results[i]["finish_reason"] for i in range(1, len(lines))]
    assert "length" in reasons and "cancelled" in reasons
    assert set(reasons) <= {"length", "cancelled"}
    # Requests running when the cancel came stop at their next step, keeping their partial text.
    partial = [
        r for r in results.values() if r["finish_reason"] == "cancelled" and r["usage"]["completion_tokens"]
    ]
    assert all(0 < r["usage"]["completion_tokens"] < 300 for r in partial)
    st = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", bid, "--json", "--redis-url", server.url],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    status = orjson.loads(st.stdout)
    assert status["state"] == "cancelled"
    assert status["failed"] == 1 and status["cancelled"] == reasons.count("cancelled")
    assert w.proc.poll() is None
    check = [sys.executable, "-m", "worker.cli", "--check", "--redis-url", server.url]
    assert subprocess.run(check, capture_output=True, cwd=ROOT, check=False).returncode == 0
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0
    assert subprocess.run(check, capture_output=True, cwd=ROOT, check=False).returncode == 1


def test_make_run_shows_the_product_on_its_demo_file(tmp_path: Path):
    """The first thing a user sees: the demo's labeling rows answer with a label and its probability, its
    free-text rows end on their own (eos / stop), not cut at max_new_tokens."""
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run(
        ["make", "run", f"PROMPTS={EXAMPLES}", f"OUT={out}"],
        capture_output=True, cwd=ROOT, env=env, timeout=900, check=False,
    )  # fmt: skip
    text = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, text
    lines = [orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines() if x.strip()]
    results = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert [r["id"] for r in results] == [x.get("id") or x.get("custom_id") for x in lines]
    assert all(r["error"] is None and r["usage"]["completion_tokens"] > 0 for r in results)
    labeled = [r for r in results if r.get("label_scores")]
    assert len(labeled) == sum("choices" in x for x in lines) >= len(lines) // 2
    assert all(r["text"] == max(r["label_scores"], key=lambda s: s["logprob"])["label"] for r in labeled)
    ended = sum(r["finish_reason"] in ("eos", "stop") for r in results)
    assert ended >= 0.9 * len(results), [(r["id"], r["finish_reason"]) for r in results]
    assert "Paris" in next(r["text"] for r in results if r["id"] == "gen-003")
    assert "labels (choices, temperature 0" in text and "p=0." in text
    assert f"summary: {len(lines)} requests" in text and "finish reasons:" in text
    assert "stopped the worker and the embedded Redis" in text


def test_worker_refuses_a_queue_bound_to_another_model(server, workers, tiny_model_dir):
    r = redis.Redis.from_url(server.url)
    r.set(keys.queue_model(keys.queue_name("default")), "some-other-model", ex=60)
    r.close()
    w = workers(server.url, str(tiny_model_dir), name="a")
    assert w.wait(120) == 1
    assert "is served by workers of model 'some-other-model'" in w.full_log()


def test_labeling_outputs_end_to_end_with_openai_format(server, workers, tiny_model_dir, tmp_path):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    lines = [
        {"id": "choice", "prompt": "Is it spam?", "choices": ["spam", "ham", "unsure"], "temperature": 0},
        {"custom_id": "json", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Answer in JSON"}], "max_tokens": 40, "temperature": 0,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}},
        {"id": "lp", "prompt": "Hello", "max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True,
         "top_logprobs": 2},
        {"id": "regex", "prompt": "Rate it", "guided_regex": "[1-5] stars", "max_new_tokens": 20, "temperature": 0},
    ]  # fmt: skip
    workers(server.url, str(tiny_model_dir), "--repetition-repeats", "0", name="a").wait_ready()
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_until(lambda: results_count(server.url, bid) == len(lines), 120, "all results")
    assert_consistent(server.url, bid, len(lines))

    def results(*args: str) -> list[dict[str, object]]:
        out = subprocess.run(
            [sys.executable, "-m", "producer.cli", "results", bid, "--redis-url", server.url, *args],
            capture_output=True, cwd=ROOT, check=True,
        )  # fmt: skip
        return [orjson.loads(x) for x in out.stdout.splitlines()]

    choice, js, lp, rx = results()
    scores = choice["label_scores"]
    assert [s["label"] for s in scores] == ["spam", "ham", "unsure"]
    assert abs(sum(s["prob"] for s in scores) - 1) < 1e-9 and choice["text"] in ("spam", "ham", "unsure")
    assert choice["text"] == max(scores, key=lambda s: s["logprob"])["label"]
    assert js["finish_reason"] == "length" or orjson.loads(js["text"])["ok"] in (True, False)
    assert rx["finish_reason"] == "length" or rx["text"] in {f"{n} stars" for n in range(1, 6)}
    content = lp["logprobs"]["content"]
    assert len(content) == 5 and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    assert "".join(bytes(t["bytes"]).decode("utf-8", "replace") for t in content) == lp["text"]
    assert "label_scores" not in js and "logprobs" not in choice  # only what was asked for
    oa = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in results("--format", "openai")}
    assert oa["lp"]["logprobs"]["tokens"] == [t["token"] for t in content]  # a completion: the legacy shape
    assert oa["json"]["logprobs"] is None and oa["choice"]["text"] == choice["text"]


def test_a_batch_shows_its_token_rate_while_requests_run_and_names_the_model_that_ran(
    shared_worker, tmp_path
):
    """Long generations: the batch's tokens_generated counter moves while no request has finished (the
    rate `producer top` and `wait` show); every result names the model that ran, and a line for another
    model is refused by name before it runs."""
    import asyncio
    import time

    from producer.cli.progress import RateWindow
    from producer.wire.store import get_status

    server, worker = shared_worker
    long = [{"id": f"long{i}", "prompt": f"story {i}", "max_new_tokens": 1000, "temperature": 0,
             "ignore_eos": True} for i in range(4)]  # fmt: skip
    other = {"custom_id": "other", "url": "/v1/completions", "body": {"model": "gpt-4o-mini", "prompt": "x"}}
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", [*long, other]))

    async def follow() -> tuple[bool, float]:
        from redis.asyncio import Redis

        r = Redis.from_url(server.url)
        live_before_finish, best_rate, window = False, 0.0, RateWindow()
        deadline = time.monotonic() + 120
        try:
            while (s := await get_status(r, bid)).done < s.total:
                assert time.monotonic() < deadline, s
                live_before_finish |= s.tokens_generated > s.completion_tokens
                best_rate = max(best_rate, window.update(s).tok_s)
                await asyncio.sleep(0.1)
            assert s.tokens_generated == s.completion_tokens  # every generated token reported once
            return live_before_finish, best_rate
        finally:
            await r.aclose()

    live, rate = asyncio.run(follow())
    assert live and rate > 0
    results = assert_consistent(server.url, bid, 5)
    assert all(
        results[i]["model"] == str(worker.model) and results[i]["finish_reason"] == "length" for i in range(4)
    )
    refused = results[4]
    assert refused["finish_reason"] == "error" and refused["error"]["type"] == "model_not_found"
    assert "gpt-4o-mini" in refused["error"]["message"] and refused["model"] is None  # nothing ran
