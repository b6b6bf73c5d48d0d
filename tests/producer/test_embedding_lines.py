"""Embedding lines at submit, without a worker: the shapes accepted, what each becomes on the wire, every
bad input refused naming its line and field; and the OpenAI output shape of an embedding result."""

from __future__ import annotations

import base64
import io
import struct
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from openai.types import CreateEmbeddingResponse

from producer.client.openai_format import openai_line
from producer.client.submit import JSON_AT, SubmitReport, validate_to_spool
from producer.wire.input_lines import MAX_EMBEDDING_INPUTS
from producer.wire.request_params import Request, SamplingParams
from producer.wire.results import Result, Usage

PRODUCER = Path(sys.executable).with_name("producer")


def spool(data: bytes, defaults: SamplingParams | None = None) -> tuple[SubmitReport, list[bytes]]:
    report = SubmitReport(batch_id="b")
    out = io.BytesIO()
    validate_to_spool(io.BytesIO(data), out, report, defaults=defaults, model=None, fingerprint="f" * 64)
    return report, out.getvalue().splitlines()


def lines(*objs: object) -> bytes:
    return b"".join(orjson.dumps(o) + b"\n" for o in objs)


def oa(body: dict[str, object], cid: str = "e") -> dict[str, object]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": body}


def test_every_input_shape_becomes_a_list_of_inputs_beside_generation_lines() -> None:
    data = lines(
        {"id": "one", "input": "a text", "dimensions": 8},
        {"id": "many", "input": ["x", "y"], "encoding_format": "base64", "timeout_s": 5},
        {"prompt": "generate me", "max_new_tokens": 3},
        oa({"model": "m", "input": [1, 2, 3], "user": "ignored"}),
        oa({"input": [[1, 2], [3]], "encoding_format": "float"}, cid="ids"),
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
    )
    defaults = SamplingParams(temperature=0.0, choices=["a", "b"], truncate_prompt="left")
    report, recs = spool(data, defaults)
    assert report.invalid == 0, [str(e) for e in report.errors]
    assert [r[:2] for r in recs] == [b"Re", b"Re", b"Rp", b"Re", b"Re", b"Rc"]
    reqs = [Request.model_validate(orjson.loads(r[JSON_AT:])) for r in recs]
    emb = [r.embedding for r in reqs]
    assert emb[0] is not None and (emb[0].input, emb[0].dimensions, emb[0].encoding_format) == (
        ["a text"],
        8,
        "float",
    )
    assert emb[1] is not None and (emb[1].input, emb[1].encoding_format) == (["x", "y"], "base64")
    assert emb[3] is not None and emb[3].input == [[1, 2, 3]]
    assert emb[4] is not None and emb[4].input == [[1, 2], [3]]
    assert emb[2] is None and emb[5] is None
    assert reqs[3].model == "m" and reqs[4].id == "ids"
    # an embedding takes the batch's time and truncation rules, never its sampling or labeling defaults
    assert reqs[0].params.model_dump(exclude_none=True) == {"max_new_tokens": 1, "truncate_prompt": "left"}
    assert reqs[1].params.timeout_s == 5 and reqs[1].params.choices is None
    assert reqs[2].params.choices == ["a", "b"]
    # never result-cached: no key, though the queue's fingerprint is known and the line is determined
    assert all(r[5:JSON_AT] == b"-" * 64 for r in recs[:2] + recs[3:5])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ({"input": ""}, "line 1: input: Value error, input 0 is empty"),
        ({"input": []}, "line 1: input: input must not be empty"),
        ({"input": ["a", ""]}, "line 1: input: input 1 is empty"),
        ({"input": [[1], []]}, "line 1: input: input 1 is empty"),
        (
            {"input": ["a", 1]},
            "line 1: input: input must be a string, a list of strings, a list of token ids",
        ),
        ({"input": [1, -2]}, "line 1: input: input must be a string"),
        ({"input": [True]}, "line 1: input: input must be a string"),
        (
            {"input": 7},
            "line 1: input: input must be a string, a list of strings, a list of token ids or a "
            "list of token-id lists, got int",
        ),
        ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "line 1: input: at most 2048 inputs per request"),
        ({"input": "a", "dimensions": 0}, "line 1: dimensions: Input should be greater than or equal to 1"),
        (
            {"input": "a", "encoding_format": "hex"},
            "line 1: encoding_format: Input should be 'float' or 'base64'",
        ),
        ({"input": "a", "temperature": 0}, "line 1: temperature: unknown field"),
        ({"input": "a", "prompt": "b"}, "line 1: prompt: unknown field"),
        (oa({"input": "a", "max_tokens": 3}), "line 1: body.max_tokens: unknown field"),
        (oa({"input": "a", "dimensions": "8"}), "line 1: body.dimensions: Input should be a valid integer"),
        (oa({"inputs": "a"}), "line 1: body.input: required field is missing"),
        ({**oa({"input": "a", "metadata": {}}), "metadata": {}}, "line 1: metadata given both on the line"),
    ],
)
def test_bad_embedding_lines_are_refused_naming_line_and_field(
    line: dict[str, object], expected: str
) -> None:
    report, _ = spool(lines(line))
    got = [str(e) for e in report.errors]
    assert report.invalid == 1 and got[0].replace("Value error, ", "").startswith(
        expected.replace("Value error, ", "")
    ), got


def test_submit_names_the_file_line_and_field_of_a_bad_embedding_line(redis_url: str, tmp_path: Path) -> None:
    if not PRODUCER.exists():
        pytest.skip("run `pip install -e .` for the console script")
    path = tmp_path / "emb.jsonl"
    path.write_bytes(lines({"input": "fine"}, oa({"input": "x", "dimensions": -1}), {"input": [[]]}))
    out = subprocess.run([str(PRODUCER), "submit", str(path), "--redis-url", redis_url],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 2, out.stderr
    err = out.stderr.splitlines()
    assert err[0] == f"error: {path}: 2 invalid line(s); nothing was enqueued"
    assert err[1] == "  line 2: body.dimensions: Input should be greater than or equal to 1"
    assert err[2] == "  line 3: input: input 0 is empty"


def test_an_embedding_result_is_openais_embedding_list_with_floats_or_base64() -> None:
    vectors = [[0.6, -0.8], [1.0, 0.0]]
    encoded = [base64.b64encode(struct.pack("<2f", *v)).decode() for v in vectors]  # what a worker writes
    for given in (vectors, encoded):
        result = Result(id="e", index=3, finish_reason="stop", usage=Usage.counted(7, 0), embeddings=given,
                        model="qwen3-embed")  # fmt: skip
        line = orjson.loads(openai_line(result, chat=False, batch_id="b", model="x", created=0))
        assert line["custom_id"] == "e" and line["error"] is None and line["response"]["status_code"] == 200
        raw_body = line["response"]["body"]
        assert set(raw_body) == {"object", "data", "model", "usage"}
        assert [d["embedding"] for d in raw_body["data"]] == given
        for d in raw_body["data"]:  # the openai client decodes base64 itself before its type sees it
            if isinstance(d["embedding"], str):
                packed = base64.b64decode(d["embedding"])
                d["embedding"] = list(struct.unpack(f"<{len(packed) // 4}f", packed))
        body = CreateEmbeddingResponse.model_validate(raw_body)
        assert body.object == "list" and body.model == "qwen3-embed"
        assert [(d.object, d.index) for d in body.data] == [("embedding", 0), ("embedding", 1)]
        assert body.usage.prompt_tokens == body.usage.total_tokens == 7
        assert [d.embedding for d in body.data] == [pytest.approx(v, abs=1e-7) for v in vectors]
        user = orjson.loads(result.to_user_json())
        assert user["embeddings"] == given and user["usage"]["prompt_tokens"] == 7
    assert "embeddings" not in orjson.loads(Result(id="t", index=0, finish_reason="eos").to_user_json())


def test_dimensions_wider_than_the_queues_model_are_refused_at_submit() -> None:
    from producer.client.submit import SubmitChecks
    from producer.wire.workers import QueueServing

    serving = QueueServing(model="m", fingerprint="f" * 64, max_model_len=64, embedding_size=32)
    data = lines(oa({"input": "a", "dimensions": 33}), {"input": "b", "dimensions": 32}, {"input": "c"},
                 oa({"model": "other", "input": "d", "dimensions": 99}, cid="o"))  # fmt: skip
    report = SubmitReport(batch_id="b")
    validate_to_spool(io.BytesIO(data), io.BytesIO(), report, defaults=None, model=None,
                      checks=SubmitChecks(serving=serving))  # fmt: skip
    assert [str(e) for e in report.errors] == [
        "line 1: body.dimensions: 33 dimensions asked, but the model 'm' serving this queue embeds in 32"
    ]
