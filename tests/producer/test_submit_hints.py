"""What `producer submit` tells a new user (issue 58): a bad --json-schema once, before any line; the
defaults it applied to lines that set none; the field an unknown one is a near miss of. Through the real
console script, on a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from producer.client.jsonl import parse_line
from producer.client.submit import ENGINE_TEMPERATURE
from worker.engine.params import GenerationParams

PRODUCER = Path(sys.executable).with_name("producer")
pytestmark = pytest.mark.skipif(not PRODUCER.exists(), reason="run `pip install -e .` for the console script")


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": url}
    return subprocess.run(
        [str(PRODUCER), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def jsonl(path: Path, *lines: object) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


THREE = ({"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"})


# ---- item 2: a bad --json-schema is one error naming the file, before any line ----


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (b'{"type": "object",\n  "properties": {"a": {"type": "strng"}}}\n', "cannot compile the JSON Schema: Invalid type: strng"),
        (b'{"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}', "cannot compile the JSON Schema: unclosed group"),
        (b'{"type": 5}', "cannot compile the JSON Schema: type must be a string or array of strings"),
        (b'{"type": "object",\n  "properties": {,}}\n', "not JSON: line 2, column 18: unexpected character, expected a string key"),
        (b'["a"]', "a JSON Schema is an object"),
    ],
)  # fmt: skip
def test_a_bad_json_schema_file_is_reported_once_naming_the_file(
    redis_url: str, tmp_path: Path, schema: bytes, reason: str
) -> None:
    data = jsonl(tmp_path / "in.jsonl", *THREE)
    path = tmp_path / "schema.json"
    path.write_bytes(schema)
    out = cli(redis_url, "submit", str(data), "--json-schema", str(path), "--batch-id", "b1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"error: --json-schema {path}: {reason}"]
    assert cli(redis_url, "status", "b1").returncode == 1  # nothing was enqueued


def test_a_bad_regex_flag_is_reported_once(redis_url: str, tmp_path: Path) -> None:
    data = jsonl(tmp_path / "in.jsonl", *THREE)
    out = cli(redis_url, "submit", str(data), "--regex", "((", "--batch-id", "b1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["error: --regex: cannot compile the regex: unclosed group"]
    assert cli(redis_url, "status", "b1").returncode == 1


def test_a_good_json_schema_file_with_a_bom_is_taken(redis_url: str, tmp_path: Path) -> None:
    data = jsonl(tmp_path / "in.jsonl", *THREE)
    path = tmp_path / "schema.json"
    path.write_bytes(b'\xef\xbb\xbf{"type": "object", "properties": {"a": {"type": "integer"}}}')
    out = cli(redis_url, "submit", str(data), "--json-schema", str(path), "--json")
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout)["enqueued"] == 3


# ---- item 7: the defaults applied to lines that set none, one line on stderr ----


def test_submit_says_it_samples_at_temperature_1_by_default_without_breaking_json(
    redis_url: str, tmp_path: Path
) -> None:
    data = jsonl(tmp_path / "in.jsonl", *THREE)
    out = cli(redis_url, "submit", str(data), "--json")
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout)["total"] == 3  # stdout is the JSON report alone
    applied = [line for line in out.stderr.splitlines() if line.startswith("defaults applied")]
    assert applied == [
        "defaults applied: temperature 1.0 (sampled; --temperature 0 for greedy), max_new_tokens 256 "
        "to 3 of 3 lines"
    ]


def test_the_defaults_line_says_which_values_went_to_how_many_lines(redis_url: str, tmp_path: Path) -> None:
    data = jsonl(
        tmp_path / "in.jsonl",
        {"prompt": "free text, no parameters"},
        {"prompt": "own temperature", "temperature": 0.2},
        {"prompt": "a label", "choices": ["yes", "no"]},  # greedy when it sets no temperature
        {"prompt": "sets both", "max_tokens": 5, "temperature": 0},
        {"input": "an embedding: no sampling, no new tokens"},
    )
    out = cli(redis_url, "submit", str(data), "--max-new-tokens", "64")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-1] == (
        "defaults applied: temperature 0.0 (greedy) to 1 of 4 lines, temperature 1.0 (sampled; "
        "--temperature 0 for greedy) to 1 of 4 lines, max_new_tokens 64 to 3 of 4 lines"
    )
    out = cli(redis_url, "submit", str(data), "--temperature", "0")
    assert out.stderr.splitlines()[-1] == (
        "defaults applied: temperature 0.0 (greedy) to 2 of 4 lines, max_new_tokens 256 to 3 of 4 lines"
    )


def test_no_defaults_line_when_every_line_sets_both(redis_url: str, tmp_path: Path) -> None:
    data = jsonl(tmp_path / "in.jsonl", {"prompt": "a", "temperature": 0.5, "max_new_tokens": 9})
    out = cli(redis_url, "submit", str(data))
    assert out.returncode == 0, out.stderr
    assert "defaults applied" not in out.stderr


def test_the_reported_default_temperature_is_the_engines() -> None:
    assert GenerationParams(max_new_tokens=1).temperature == ENGINE_TEMPERATURE


# ---- item 11a: an unknown field names the known one it is a near miss of ----


def test_an_unknown_field_near_a_known_one_says_which(redis_url: str, tmp_path: Path) -> None:
    data = jsonl(
        tmp_path / "in.jsonl",
        {"prompt": "a", "temprature": 0},
        {"prompt": "b", "max_token": 5},
        {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "c", "temprature": 0}},
        {"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "d", "max_completion_token": 5}},
        {"prompt": "e", "colour": 1},  # near nothing: no guess
    )
    out = cli(redis_url, "submit", str(data), "--batch-id", "b1")
    assert out.returncode == 2
    assert out.stderr.splitlines()[1:] == [
        "  line 1: temprature: unknown field (did you mean temperature?)",
        "  line 2: max_token: unknown field (did you mean max_tokens?)",
        "  line 3: body.temprature: unknown field (did you mean temperature?)",
        "  line 4: body.max_completion_token: unknown field (did you mean max_completion_tokens?)",
        "  line 5: colour: unknown field",
    ]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ({"messages": [{"role": "user", "content": "x", "nmae": "u"}]}, "messages.0.nmae: unknown field (did you mean name?)"),
        ({"prompt": "x", "guided_regx": "a+"}, "guided_regx: unknown field (did you mean guided_regex?)"),
        ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strct": True}}},
         "response_format.json_schema.strct: unknown field (did you mean strict?)"),
        ({"prompt": "x", "metdata": {}}, "metdata: unknown field (did you mean metadata?)"),
        ({"custom_id": "a", "url": "/v1/completions", "metdata": {}, "body": {"prompt": "x"}},
         "metdata: unknown field (did you mean metadata?)"),
        ({"input": "x", "dimension": 8}, "dimension: unknown field (did you mean dimensions?)"),
        ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x", "encoding": "float"}},
         "body.encoding: unknown field (did you mean encoding_format?)"),
    ],
)  # fmt: skip
def test_near_misses_are_found_in_every_shape_and_nested_object(
    line: dict[str, object], expected: str
) -> None:
    got = parse_line(orjson.dumps(line), 1, 0, batch_id="b", defaults=None, model=None)
    assert isinstance(got, list) and f"line 1: {expected}" in [str(e) for e in got]
