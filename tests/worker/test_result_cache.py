"""The result cache: what its key depends on, and nightly reruns answered from it by a real worker."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis as sync_redis
import torch

from producer.client.submit import JSON_AT, SubmitReport, validate_to_spool
from producer.wire import keys
from producer.wire.request_params import Request, SamplingParams
from producer.wire.result_cache import request_key
from tests.tiny_models import build_tiny_checkpoint, byte_tokenizer
from tests.worker.conftest import ROOT, assert_consistent, results_count, wait_until, write_jsonl
from worker.engine.fingerprint import NUMERICS_VERSION, engine_fingerprint, tokenizer_digest, weights_digest
from worker.models.loader import load_model
from worker.queue.cached_results import key_of

FP = "f" * 32
PROMPT = "Label this: fine"
SEEDED = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "seed": 3}

# Every wire parameter that can change the tokens or the text, with another value for it.
OUTPUT_FIELDS = {
    "max_new_tokens": 9, "temperature": 0.8, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3,
    "seed": 4, "stop": ["x"], "stop_token_ids": [9], "include_stop_str_in_output": True, "ignore_eos": True,
    "truncate_prompt": "left", "choices": ["a", "b"], "regex": "[a-z]+", "logprobs": True, "top_logprobs": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"7": 3.0}, "n": 2, "best_of": 3,
    "max_reasoning_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
}  # fmt: skip


def key(params: dict[str, object], prompt: str = PROMPT, fp: str = FP) -> str | None:
    return request_key(fp, prompt, None, params)


def test_every_parameter_field_is_classified() -> None:
    assert set(SamplingParams.model_fields) == set(OUTPUT_FIELDS) | {"timeout_s", "structured_outputs"}


def test_n_and_best_of_count_only_where_they_change_the_answer() -> None:
    # n=1 (and best_of == n) keeps the key requests had before n > 1 existed: their cached answers stay valid
    assert key({**SEEDED, "n": 1}) == key({**SEEDED, "n": 1, "best_of": 1}) == key(SEEDED)
    assert (
        key({**SEEDED, "n": 3, "best_of": 3})
        == key({**SEEDED, "n": 3})
        != key({**SEEDED, "n": 3, "best_of": 4})
    )


@pytest.mark.parametrize("field", sorted(OUTPUT_FIELDS))
def test_the_key_misses_when_an_output_changing_parameter_differs(field: str) -> None:
    assert key({**SEEDED, field: OUTPUT_FIELDS[field]}) != key(SEEDED)


def test_the_key_misses_when_the_prompt_or_the_engine_differs() -> None:
    k = key(GREEDY)
    assert k is not None and k.startswith("batchq:result-cache:")
    assert key(GREEDY, prompt=PROMPT + " ") != k
    assert key(GREEDY, fp="e" * 32) != k
    msgs = [{"role": "user", "content": PROMPT}]
    assert request_key(FP, None, msgs, GREEDY) not in (k, None)
    assert request_key(FP, None, [{**msgs[0], "name": None}], GREEDY) == request_key(FP, None, msgs, GREEDY)


def test_what_cannot_change_the_output_does_not_change_the_key() -> None:
    k = key(GREEDY)
    assert key({**GREEDY, "timeout_s": 5.0}) == k
    for field in ("seed", "top_p", "top_k", "min_p"):  # greedy decoding takes the argmax before these
        assert key({**GREEDY, field: OUTPUT_FIELDS[field]}) == k


def test_unseeded_sampling_is_never_cached() -> None:
    assert key({**SEEDED, "seed": None}) is None
    assert key({"max_new_tokens": 8}) is None  # temperature unset: the engine samples at 1
    assert key(SEEDED) is not None


def test_submit_and_worker_compute_the_same_key_for_every_input_shape() -> None:
    lines = [
        {"id": "a", "prompt": "x", "temperature": 0, "stop": "###"},
        {"id": "b", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
         "temperature": 0.5, "seed": 7, "max_tokens": 3},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi", "name": "me"}], "temperature": 0}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "seed": 1}},
    ]  # fmt: skip
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    spool = io.BytesIO()
    report = SubmitReport(batch_id="b1")
    validate_to_spool(io.BytesIO(data), spool, report, defaults=SamplingParams(temperature=0.2), model=None,
                      fingerprint=FP)  # fmt: skip
    for rec in spool.getvalue().splitlines():
        req = Request.model_validate(orjson.loads(rec[JSON_AT:]))
        want = key_of(FP, req)
        assert want is not None
        assert rec[5:JSON_AT].decode() == want.rpartition(":")[2], req.id


def test_the_fingerprint_follows_the_weights_the_dtype_and_the_numerics(tmp_path: Path) -> None:
    a = build_tiny_checkpoint(tmp_path / "a", "llama", seed=0)
    b = build_tiny_checkpoint(tmp_path / "b", "llama", seed=1)
    cpu = torch.device("cpu")
    wa = weights_digest(load_model(str(a), torch.float32, cpu).model)
    assert weights_digest(load_model(str(a), torch.float32, cpu).model) == wa  # stable across loads
    assert weights_digest(load_model(str(b), torch.float32, cpu).model) != wa  # other weights
    assert weights_digest(load_model(str(a), torch.bfloat16, cpu).model) != wa  # other dtype
    assert engine_fingerprint(wa, device="cpu") != engine_fingerprint(wa, device="cuda")
    assert NUMERICS_VERSION >= 1


def test_the_fingerprint_follows_the_tokenizer_and_the_chat_template() -> None:
    plain, chat = byte_tokenizer(chat_template=False), byte_tokenizer()
    assert tokenizer_digest(chat) == tokenizer_digest(byte_tokenizer())
    assert tokenizer_digest(plain) != tokenizer_digest(chat)
    chat.chat_template = chat.chat_template + " "
    assert tokenizer_digest(chat) != tokenizer_digest(byte_tokenizer())


# ---- a nightly rerun, end to end ---------------------------------------------------------------------


def results_of(url: str, batch_id: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "results", batch_id, "--redis-url", url],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return [orjson.loads(x) for x in out.stdout.splitlines()]


def status_of(url: str, batch_id: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", batch_id, "--json", "--redis-url", url],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return dict(orjson.loads(out.stdout))


def serving_fingerprint(url: str) -> str:
    """The engine fingerprint the queue's workers published (a worker publishes it as it starts)."""
    r = sync_redis.Redis.from_url(url)
    try:
        wait_until(
            lambda: r.exists(keys.queue_serving(keys.queue_name("default"))), 30, "the published engine"
        )
        return str(orjson.loads(r.get(keys.queue_serving(keys.queue_name("default"))))["fingerprint"])
    finally:
        r.close()


def submit_json(url: str, path: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--redis-url", url, "--json", *args],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return dict(orjson.loads(out.stdout))


@pytest.mark.slow
def test_a_rerun_batch_is_answered_at_submit_with_the_original_answers(
    server, workers, tiny_model_dir, tmp_path
) -> None:
    lines = [
        {"id": f"g{i}", "prompt": f"Label item {i}:", "max_new_tokens": 6, "temperature": 0} for i in range(6)
    ]
    lines += [{"id": f"s{i}", "prompt": f"Write {i}", "max_new_tokens": 6, "temperature": 0.9, "seed": i}
              for i in range(3)]  # fmt: skip
    lines += [{"id": "u0", "prompt": "Write freely", "max_new_tokens": 6, "temperature": 0.9}]  # unseeded
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    worker_a = workers(server.url, str(tiny_model_dir), "--repetition-repeats", "0", name="a").wait_ready()
    fingerprint_a = serving_fingerprint(server.url)

    first = submit_json(server.url, path)
    assert first["cached"] == 0
    wait_until(lambda: results_count(server.url, first["batch_id"]) == len(lines), 120, "the first run")
    again = submit_json(server.url, path)  # the worker published its fingerprint: answered at submit
    assert (again["cached"], again["enqueued"]) == (9, 1)  # unseeded sampling never hits
    wait_until(lambda: results_count(server.url, again["batch_id"]) == len(lines), 120, "the rerun")
    fresh = submit_json(server.url, path, "--no-result-cache")
    assert (fresh["cached"], fresh["enqueued"]) == (0, len(lines))
    wait_until(lambda: results_count(server.url, fresh["batch_id"]) == len(lines), 120, "the recomputation")
    runs = [first["batch_id"], again["batch_id"], fresh["batch_id"]]
    for bid in runs:
        assert_consistent(server.url, bid, len(lines))

    one, two, three = (results_of(server.url, bid) for bid in runs)
    assert not any(r["cached"] for r in one) and not any(r["cached"] for r in three)
    assert [r["cached"] for r in two] == [True] * 9 + [False]
    for a, b, c in zip(one[:9], two[:9], three[:9], strict=True):
        assert a["text"] == b["text"] == c["text"], a["id"]  # a hit is what the engine computes afresh
        assert a["usage"] == b["usage"] and a["finish_reason"] == b["finish_reason"]
    assert status_of(server.url, again["batch_id"])["from_result_cache"] == 9
    assert status_of(server.url, fresh["batch_id"])["from_result_cache"] == 0

    # Without a published fingerprint (no worker has served the queue lately), submit cannot look up:
    # the next worker answers from the cache itself.
    worker_a.signal(signal.SIGTERM)
    assert worker_a.wait(30) == 0
    r = sync_redis.Redis.from_url(server.url)
    r.delete(keys.queue_serving(keys.queue_name("default")))
    r.close()
    late = submit_json(server.url, path)
    assert late["cached"] == 0
    worker_b = workers(server.url, str(tiny_model_dir), "--repetition-repeats", "0", name="b").wait_ready()
    wait_until(lambda: results_count(server.url, late["batch_id"]) == len(lines), 120, "the late rerun")
    # the same machine and settings give the same engine: a timing (the dtype probe) must not tell them apart
    assert serving_fingerprint(server.url) == fingerprint_a, worker_b.log()
    four = results_of(server.url, late["batch_id"])
    assert [r["cached"] for r in four] == [True] * 9 + [False]
    assert [r["text"] for r in four[:9]] == [r["text"] for r in one[:9]]
    assert all(r["model"] == str(tiny_model_dir) for r in four)  # a cached answer names its model
