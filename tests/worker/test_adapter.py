"""The translation between the wire contract and the engine's own types (worker/queue/adapter.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from producer.wire.request_params import BUILTIN_DEFAULTS, Request, SamplingParams
from worker.engine.params import GenerationParams
from worker.queue.adapter import engine_request, generation_params


def test_every_contract_parameter_has_an_engine_field() -> None:
    # structured_outputs folds into choices / regex / response_format, and those two become the engine's
    # one grammar constraint; the template's variables go with the request.
    template = {"chat_template_kwargs", "reasoning_effort"}
    contract = set(SamplingParams.model_fields) - {
        "structured_outputs",
        "response_format",
        "regex",
        *template,
    }
    assert contract | {"constraint"} == {f.name for f in dataclasses.fields(GenerationParams)}


def test_unset_parameters_take_the_engines_defaults() -> None:
    got = generation_params(SamplingParams().resolve())
    neutral = GenerationParams(max_new_tokens=BUILTIN_DEFAULTS["max_new_tokens"], seed=got.seed)
    assert got == neutral
    assert (got.temperature, got.top_p, got.stop, got.timeout_s, got.truncate_prompt) == (
        1.0,
        1.0,
        (),
        math.inf,
        "error",
    )


def test_unseeded_requests_get_a_fresh_seed_each_and_a_given_seed_is_kept() -> None:
    seeds = {generation_params(SamplingParams(max_new_tokens=4)).seed for _ in range(20)}
    assert len(seeds) == 20
    assert generation_params(SamplingParams(max_new_tokens=4, seed=7)).seed == 7


def test_set_parameters_pass_through_with_the_engines_types() -> None:
    wire = {"max_tokens": 9, "temperature": 0.0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2,
            "seed": 11, "stop": "###", "stop_token_ids": [5, 6], "include_stop_str_in_output": True,
            "ignore_eos": True, "timeout_s": 2.5, "truncate_prompt": "left"}  # fmt: skip
    got = generation_params(SamplingParams.model_validate(wire))
    assert got == GenerationParams(
        max_new_tokens=9, temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2, seed=11,
        stop=("###",), stop_token_ids=(5, 6), include_stop_str_in_output=True, ignore_eos=True, timeout_s=2.5,
        truncate_prompt="left",
    )  # fmt: skip


def test_a_queued_request_becomes_an_engine_request_under_its_job_id() -> None:
    req = Request.model_validate(
        {
            "batch_id": "b",
            "id": "r1",
            "index": 0,
            "messages": [{"role": "user", "content": "hi"}],
            "params": {"max_new_tokens": 3},
        }
    )
    ereq = engine_request(req, "b:0")
    assert (ereq.request_id, ereq.prompt, ereq.messages) == ("b:0", None, [{"role": "user", "content": "hi"}])
    assert ereq.params.max_new_tokens == 3 and ereq.started_at is not None


def test_a_queued_request_without_max_new_tokens_is_refused_by_the_contract() -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be set"):
        Request.model_validate({"batch_id": "b", "id": "r", "index": 0, "prompt": "x", "params": {}})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("temperature", -1.0),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.0),
        ("repetition_penalty", 0.0),
        ("seed", -1),
        ("stop", ("",)),
        ("timeout_s", 0.0),
        ("truncate_prompt", "middle"),
    ],
)
def test_the_engine_refuses_bad_parameters_by_name(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"max_new_tokens": 4, field: value}
    with pytest.raises(ValueError, match=f"invalid generation parameter.*{field}="):
        GenerationParams(**kwargs)  # type: ignore[arg-type]


def test_an_embedding_request_reaches_the_engine_and_its_vectors_come_back_as_asked() -> None:
    import base64
    import struct

    from worker.engine.request import EmbeddingInputs, EngineResult
    from worker.queue.adapter import to_result

    for fmt in ("float", "base64"):
        req = Request.model_validate({
            "batch_id": "b", "id": "e", "index": 2, "params": {"max_new_tokens": 1, "timeout_s": 3.0},
            "embedding": {"input": [[5, 6], [7]], "dimensions": 2, "encoding_format": fmt},
        })  # fmt: skip
        ereq = engine_request(req, "b:2")
        assert ereq.embedding == EmbeddingInputs([[5, 6], [7]], 2) and ereq.prompt is None
        assert ereq.params.timeout_s == 3.0
        vectors = [[0.6, 0.8], [-1.0, 0.0]]
        res = EngineResult(
            request_id="b:2", text="", token_ids=[], finish_reason="stop", prompt_tokens=3, completion_tokens=0,
            cached_tokens=1, ttft_s=None, total_s=0.1, error=None, label_scores=None, logprobs=None,
            embeddings=vectors,
        )  # fmt: skip
        result = to_result(req, res, None, "w", "m")
        assert result.usage.prompt_tokens == 3 and result.usage.prompt_tokens_details.cached_tokens == 1
        assert result.embeddings is not None
        if fmt == "float":
            assert result.embeddings == vectors
        else:
            decoded = [struct.unpack("<2f", base64.b64decode(e)) for e in result.embeddings]  # type: ignore[arg-type]
            assert [list(d) for d in decoded] == [pytest.approx(v, abs=1e-7) for v in vectors]


def test_a_request_holds_one_kind_of_input() -> None:
    base = {"batch_id": "b", "id": "e", "index": 0, "params": {"max_new_tokens": 1}}
    with pytest.raises(ValueError, match="an embedding request has no 'prompt' or 'messages'"):
        Request.model_validate({**base, "prompt": "x", "embedding": {"input": ["x"]}})
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'messages'"):
        Request.model_validate(base)
