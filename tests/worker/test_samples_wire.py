"""n > 1 across the wire: queued request -> engine -> stored result, its JSONL line, its OpenAI line and its
result-cache answer, on a tiny random Llama with the byte tokenizer (worker/queue/adapter.py and the contract)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from producer.client.openai_format import openai_line
from producer.wire.request_params import Request
from producer.wire.result_cache import CachedAnswer, cacheable
from producer.wire.results import Result
from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine_config import EngineConfig
from worker.queue.adapter import engine_request, to_result

N1_KEYS = {"id", "text", "finish_reason", "usage", "timing", "error", "metadata", "cached", "model"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return Engine.load(EngineConfig(dtype="float32", model=str(ckpt), kv_cache_gb=0.01, block_size=8))


def answer(engine: Engine, **params: Any) -> tuple[Request, Result]:
    req = Request.model_validate({
        "batch_id": "b", "id": "r", "index": 0, "prompt": "Is this fine? Answer:",
        "params": {"max_new_tokens": 6, **params},
    })  # fmt: skip
    (res,) = engine.generate([engine_request(req, "b:0")])
    return req, to_result(req, res, 0.0, "w", "tiny")


def test_n1_lines_keep_todays_shape(engine: Engine) -> None:
    _, result = answer(engine, temperature=0, n=1)
    assert set(orjson.loads(result.to_user_json())) == N1_KEYS
    assert result.choices is None and result.vote is None


def test_n3_results_list_every_sample_and_count_the_prompt_once(engine: Engine) -> None:
    _, result = answer(engine, temperature=0.9, seed=5, n=3, logprobs=True)
    line = orjson.loads(result.to_user_json())
    assert set(line) == N1_KEYS | {"choices", "logprobs"}
    choices = line["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert set(choices[0]) == {"index", "text", "finish_reason", "completion_tokens", "logprobs"}
    assert line["text"] == choices[0]["text"] and line["finish_reason"] == choices[0]["finish_reason"]
    usage = line["usage"]
    assert usage["completion_tokens"] == sum(c["completion_tokens"] for c in choices)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    _, alone = answer(engine, temperature=0.9, seed=5, logprobs=True)  # sample 0 is the n=1 request
    assert alone.text == choices[0]["text"] and alone.usage.prompt_tokens == usage["prompt_tokens"]


def test_choices_with_n_vote_and_report_agreement(engine: Engine) -> None:
    labels = ["yes", "no", "maybe"]
    _, result = answer(engine, choices=labels, temperature=30.0, seed=1, n=9)
    assert result.vote is not None and list(result.vote) == labels  # every label, in request order
    assert sum(result.vote.values()) == 9
    assert [c.text for c in result.choices or []].count("yes") == result.vote["yes"]
    assert result.agreement == max(result.vote.values()) / 9
    line = orjson.loads(result.to_user_json())
    assert line["vote"] == result.vote and line["agreement"] == result.agreement and "label_scores" in line
    _, greedy = answer(engine, choices=labels, n=4)  # temperature 0 (the choices default): unanimous
    assert greedy.agreement == 1.0 and greedy.vote is not None and greedy.vote[greedy.text] == 4


@pytest.mark.parametrize("chat", [True, False])
def test_the_openai_line_has_a_choice_per_sample_and_usage_once(engine: Engine, chat: bool) -> None:
    _, result = answer(engine, temperature=0.8, seed=2, n=2, best_of=3)
    line = orjson.loads(openai_line(result, chat=chat, batch_id="b", model="tiny", created=1))
    body = line["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    texts = [c["message"]["content"] if chat else c["text"] for c in body["choices"]]
    assert texts == [c.text for c in result.choices or []]
    assert body["usage"]["prompt_tokens"] == result.usage.prompt_tokens
    assert body["usage"]["completion_tokens"] == result.usage.completion_tokens  # best_of's 3 samples


def test_a_cached_answer_holds_every_sample(engine: Engine) -> None:
    _, result = answer(engine, choices=["a", "b"], temperature=5.0, seed=3, n=3)
    assert cacheable(result)
    stored = CachedAnswer.from_json(CachedAnswer.of(result).to_json())
    hit = stored.result("r", 0, None, timing=result.timing, worker="w2")
    assert hit.cached and hit.choices == result.choices and hit.vote == result.vote
    assert hit.agreement == result.agreement and hit.usage == result.usage
    unfinished = result.model_copy(update={"choices": [c.model_copy(update={"finish_reason": "timeout"})
                                                       for c in result.choices or []]})  # fmt: skip
    assert not cacheable(unfinished)


def test_an_n1_cached_answer_is_stored_as_before(engine: Engine) -> None:
    _, result = answer(engine, temperature=0)
    assert set(orjson.loads(CachedAnswer.of(result).to_json())) == {
        "text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "model"
    }  # fmt: skip


def test_sample_requests_roundtrip_through_the_queue_payload(engine: Engine) -> None:
    req, result = answer(engine, temperature=0.7, seed=9, n=2, best_of=4)
    again = Request.model_validate(orjson.loads(orjson.dumps(req.model_dump(mode="json"))))
    assert (again.params.n, again.params.best_of) == (2, 4)
    assert Result.from_json(result.to_json()) == result
