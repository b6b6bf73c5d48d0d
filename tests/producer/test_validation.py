"""Input validation, line by line, without Redis: what a user sees for each kind of bad line."""

from __future__ import annotations

import io

import orjson
import pytest

from producer.client.jsonl import MAX_LINE_BYTES
from producer.client.submit import JSON_AT, SubmitChecks, SubmitReport, validate_to_spool
from producer.wire.request_params import Request, SamplingParams


def validate(
    data: bytes, defaults: SamplingParams | None = None, model: str | None = None, **checks: object
) -> tuple[SubmitReport, list[bytes]]:
    report = SubmitReport(batch_id="b")
    spool = io.BytesIO()
    validate_to_spool(
        io.BytesIO(data), spool, report, defaults=defaults, model=model,
        checks=SubmitChecks(**checks),  # type: ignore[arg-type]
    )  # fmt: skip
    return report, spool.getvalue().splitlines()


def requests(data: bytes, defaults: SamplingParams | None = None) -> list[Request]:
    report, recs = validate(data, defaults)
    assert report.invalid == 0, [str(e) for e in report.errors]
    return [
        Request.model_validate(orjson.loads(r[JSON_AT:])) for r in recs
    ]  # b"R" + kind + order + key + JSON


def errors(data: bytes) -> list[str]:
    report, _ = validate(data)
    return [str(e) for e in report.errors]


def test_three_input_shapes_become_requests_with_resolved_params() -> None:
    data = b"\n".join(
        [
            b'{"id": "r1", "prompt": "continue this", "temperature": 0, "stop": "###", "metadata": {"k": 1}}',
            b"",
            b'{"id": "r2", "messages": [{"role": "system", "content": "be brief"}, '
            b'{"role": "user", "content": "hi"}], "max_tokens": 5}',
            b'{"custom_id": "r3", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50}}',
            b'{"custom_id": "r4", "method": "POST", "url": "/v1/completions", '
            b'"body": {"prompt": "abc", "max_completion_tokens": 7, "seed": 3}}',
        ]
    )
    reqs = requests(data, SamplingParams(max_new_tokens=99, temperature=0.7))
    assert [r.id for r in reqs] == ["r1", "r2", "r3", "r4"]
    assert [r.index for r in reqs] == [0, 1, 2, 3]  # position among non-blank lines
    r1, r2, r3, r4 = reqs
    assert r1.prompt == "continue this" and r1.params.temperature == 0.0 and r1.params.stop == ["###"]
    assert r1.params.max_new_tokens == 99 and r1.metadata == {"k": 1}
    assert r2.messages is not None and r2.messages[0].role == "system" and r2.params.max_new_tokens == 5
    assert r2.params.temperature == 0.7
    assert r3.params.max_new_tokens == 50 and r3.model == "gpt-4o-mini"  # the model the line names
    assert r1.model is None  # no model named: whatever the queue serves
    assert r4.prompt == "abc" and r4.params.max_new_tokens == 7 and r4.params.seed == 3
    assert all(
        r.params.top_p is None for r in reqs
    )  # unset: the engine's default applies (worker/queue/adapter.py)


def test_openai_body_model_is_recorded_in_the_batch() -> None:
    line = b'{"url": "/v1/chat/completions", "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "x"}]}}'
    report, _ = validate(line)
    assert report.invalid == 0 and report.body_model == "gpt-x"


def test_missing_id_defaults_to_the_line_number() -> None:
    reqs = requests(b'\n{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert [(r.id, r.index) for r in reqs] == [("2", 0), ("4", 1)]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"prompt": "x"', "line 1: invalid JSON"),
        (b'["prompt"]', "line 1: expected a JSON object, got list"),
        (b'{"prompt": 5}', "line 1: prompt: Input should be a valid string"),
        (
            b'{"prompt": "x", "max_new_tokens": true}',
            "line 1: max_new_tokens: Input should be a valid integer",
        ),
        (b'{"prompt": "x", "temperature": "0.5"}', "line 1: temperature: Input should be a valid number"),
        (
            b'{"prompt": "x", "temperature": -1}',
            "line 1: temperature: Input should be greater than or equal to 0",
        ),
        (b'{"prompt": "x", "top_p": 1.5}', "line 1: top_p: Input should be less than or equal to 1"),
        (
            b'{"prompt": "x", "max_tokens": 0}',
            "line 1: max_tokens: Input should be greater than or equal to 1",
        ),  # as written
        (b'{"prompt": "x", "n": 0}', "line 1: n: Input should be greater than or equal to 1"),
        (
            b'{"prompt": "x", "n": 4, "best_of": 2}',
            "line 1: best_of: best_of must be >= n: best_of is 2, n is 4",
        ),
        (b'{"prompt": "x", "best_of": 129}', "line 1: best_of: Input should be less than or equal to 128"),
        (b'{"prompt": "x", "stop": [""]}', "line 1: stop: stop strings must be non-empty"),
        (
            b'{"prompt": "x", "truncate_prompt": "middle"}',
            "line 1: truncate_prompt: Input should be 'left' or 'right'",
        ),
        (b'{"prompt": "x", "temprature": 0}', "line 1: temprature: unknown field"),
        (b'{"prompt": ""}', "line 1: prompt must be non-empty"),
        (b'{"id": "a"}', "line 1: exactly one of 'prompt' or 'messages' is required"),
        (b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "line 1: exactly one of"),
        (b'{"messages": []}', "line 1: messages must be a non-empty list"),
        (b'{"messages": [{"role": "robot", "content": "y"}]}', "line 1: messages.0.role: Input should be"),
        (b'{"id": 7, "prompt": "x"}', "line 1: id: Input should be a valid string"),
        (b'{"id": "", "prompt": "x"}', "line 1: id: String should have at least 1 character"),
        (b'{"url": "/v1/responses", "body": {"input": "x"}}', "line 1: url: Input should be"),
        (
            b'{"url": "/v1/chat/completions", "body": {"prompt": "x"}}',
            "line 1: /v1/chat/completions needs body.messages",
        ),
        (
            b'{"method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}',
            "line 1: method: Input should be",
        ),
        (
            b'{"url": "/v1/completions", "body": {"prompt": "x", "stream": true}}',
            "line 1: body: 'stream' = True is unsupported",
        ),
        (b'{"custom_id": "a", "url": "/v1/completions"}', "line 1: body: required field is missing"),
        (b'{"prompt": "x", "choices": ["a", "a"]}', "line 1: choices must be distinct: 'a' appears twice"),
        (b'{"prompt": "x", "choices": ["a"]}', "line 1: choices needs 2 to 256 labels, got 1"),
        (b'{"prompt": "x", "choices": ["a", ""]}', "line 1: choices must be non-empty strings"),
        (b'{"prompt": "x", "guided_choice": "ab"}', "line 1: guided_choice: Input should be a valid list"),
        (b'{"prompt": "x", "choices": ["a", "b"], "regex": "a"}', "line 1: give at most one of choices"),
        (
            b'{"prompt": "x", "response_format": {"type": "json_schema"}}',
            "line 1: response_format: json_schema is",
        ),
        (
            b'{"prompt": "x", "response_format": {"type": "yaml"}}',
            "line 1: response_format.type: Input should be",
        ),
        (b'{"prompt": "x", "top_logprobs": 3}', "line 1: top_logprobs needs logprobs: true"),
        (
            b'{"prompt": "x", "logprobs": true, "top_logprobs": 21}',
            "line 1: top_logprobs: Input should be less",
        ),
        (
            b'{"prompt": "x", "structured_outputs": {"grammar": "x"}}',
            "line 1: structured_outputs.grammar: unknown",
        ),
        (
            b'{"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "y"}], '
            b'"structured_outputs": {"choice": ["p", "p"]}}}',
            "line 1: body: choices must be distinct",
        ),
    ],
)
def test_each_bad_line_names_line_field_and_reason(line: bytes, expected: str) -> None:
    errs = errors(line)
    assert len(errs) == 1 and errs[0].startswith(expected), errs


def test_duplicate_ids_are_reported_with_the_first_line() -> None:
    errs = errors(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    assert errs == ["line 3: id: duplicate id 'a' (first on line 1)"]


def test_default_id_colliding_with_an_explicit_id_is_a_duplicate() -> None:
    errs = errors(b'{"id": "2", "prompt": "x"}\n{"prompt": "y"}\n')
    assert errs == [
        "line 2: id: duplicate id '2' (the id given to line 2, which has none of its own; first on line 1)"
    ]
    errs = errors(b'{"prompt": "x"}\n{"id": "1", "prompt": "y"}\n')
    assert errs == [
        "line 2: id: duplicate id '1' (first on line 1, where it is the id given to line 1, which has none "
        "of its own)"
    ]


def test_non_utf8_bytes_name_the_line() -> None:
    errs = errors(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    assert errs == ["line 2: not valid UTF-8 (byte 15 of the line)"]


def test_bom_at_file_start_is_accepted_but_not_elsewhere() -> None:
    assert [r.prompt for r in requests(b'\xef\xbb\xbf{"prompt": "x"}\n')] == ["x"]
    assert errors(b'{"prompt": "x"}\n\xef\xbb\xbf{"prompt": "y"}\n')[0].startswith(
        "line 2: invalid JSON at column 1"
    )


def test_crlf_line_endings_and_missing_final_newline_are_fine() -> None:
    assert [r.prompt for r in requests(b'{"prompt": "a"}\r\n{"prompt": "b"}')] == ["a", "b"]


def test_a_10mb_prompt_is_accepted() -> None:
    big = "x" * (10 * 1024 * 1024)
    (req,) = requests(orjson.dumps({"prompt": big}) + b"\n")
    assert req.prompt is not None and len(req.prompt) == len(big)


def test_a_line_over_the_limit_is_refused_without_stopping_validation() -> None:
    huge = b'{"prompt": "' + b"y" * (MAX_LINE_BYTES + 10) + b'"}\n'
    report, _ = validate(huge + b'{"prompt": }\n{"prompt": "ok"}\n')
    assert [str(e) for e in report.errors] == [
        f"line 1: line is longer than {MAX_LINE_BYTES} bytes",
        "line 2: invalid JSON at column 12: unexpected character, expected a JSON value",
    ]
    assert report.total == 3


def test_only_the_first_20_bad_lines_are_kept_but_all_are_counted() -> None:
    report, _ = validate(b"nope\n" * 50 + b'{"prompt": "fine"}\n')
    assert len(report.errors) == 20 and report.invalid == 50 and report.total == 51


def test_labeling_fields_in_every_spelling_become_one_resolved_form() -> None:
    lines = (
        b'{"prompt": "a", "guided_choice": ["x", "y"]}\n'
        b'{"prompt": "b", "structured_outputs": {"choice": ["x", "y"]}}\n'
        b'{"prompt": "c", "guided_regex": "[a-z]+", "logprobs": 4}\n'
        b'{"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "d"}], '
        b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}}}\n'
        b'{"prompt": "e", "response_format": {"type": "text"}, "logprobs": true, "top_logprobs": 2}\n'
    )
    a, b, c, d, e = requests(
        lines, SamplingParams(regex="[0-9]+")
    )  # a line's constraint replaces the batch's
    assert a.params.choices == b.params.choices == ["x", "y"] and a.params.regex is None
    assert (c.params.regex, c.params.logprobs, c.params.top_logprobs) == ("[a-z]+", True, 4)
    assert d.params.response_format is not None and d.params.response_format.json_schema is not None
    assert d.params.response_format.json_schema.schema_ == {"type": "object"} and d.params.regex is None
    assert e.params.response_format is None and e.params.regex == "[0-9]+"  # text is no constraint
    assert (e.params.logprobs, e.params.top_logprobs) == (True, 2)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # A truncated line: orjson reports "line 2, column 1" past the final newline; the user needs the
        # column where their line stops.
        (
            b'{"id": "a", "prompt": "x"\n',
            "line 1: invalid JSON: the line ends at column 26 inside a JSON value",
        ),
        (
            b'{"id": "a", "prompt": "x\n',
            "line 1: invalid JSON: the line ends at column 25 inside a JSON value",
        ),
        (b'{"id": "a" "prompt": 1}\n', "line 1: invalid JSON at column 12: unexpected character"),
        (
            b'{"id": "\xc3\xa9t\xc3\xa9" "prompt": 1}\n',
            "line 1: invalid JSON at column 14: unexpected character",
        ),
        (
            b'{"id": "a", "prompt": "x"}}\n',
            "line 1: invalid JSON at column 27: unexpected content after document",
        ),
    ],
)
def test_invalid_json_names_the_real_column(line: bytes, expected: str) -> None:
    assert errors(line)[0].startswith(expected)


def test_a_choices_request_without_a_temperature_answers_its_argmax_label() -> None:
    """Sampling a label at temperature 1 flipped rows between two runs of the same file: a labeling
    request that sets no temperature (neither on its line nor in the batch defaults) is greedy."""
    data = (
        b'{"prompt": "a", "choices": ["x", "y"]}\n'
        b'{"prompt": "b", "choices": ["x", "y"], "temperature": 0.9, "seed": 1}\n'
        b'{"prompt": "c"}\n'
        b'{"custom_id": "d", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
        b'"content": "d"}], "response_format": {"type": "json_object"}}}\n'
    )
    a, b, c, d = requests(data)
    assert a.params.temperature == 0.0 and b.params.temperature == 0.9
    assert c.params.temperature is None and d.params.temperature is None  # the engine's default
    (e,) = requests(b'{"prompt": "e", "choices": ["x", "y"]}\n', SamplingParams(temperature=0.5))
    assert e.params.temperature == 0.5  # the batch's own temperature is a choice the user made
    (f,) = requests(b'{"prompt": "f"}\n', SamplingParams(choices=["x", "y"]))
    assert f.params.temperature == 0.0


def test_a_line_naming_another_model_than_the_batch_is_refused_and_aliases_map_names() -> None:
    line = (
        b'{"custom_id": "r", "url": "/v1/chat/completions", "body": {"model": "gpt-4o-mini", '
        b'"messages": [{"role": "user", "content": "x"}]}}\n'
    )
    report, _ = validate(line, model="smollm2-135m")
    assert [str(e) for e in report.errors] == [
        "line 1: body.model: 'gpt-4o-mini' differs from the batch's model 'smollm2-135m'; leave --model out "
        "to run each line on its own model, or map the name: --model-alias gpt-4o-mini=smollm2-135m"
    ]
    (r,) = requests_with(line, model="smollm2-135m", aliases={"gpt-4o-mini": "smollm2-135m"})
    assert r.model == "smollm2-135m"
    (r,) = requests_with(line, model=None, aliases={"gpt-4o-mini": "smollm2-135m"})
    assert r.model == "smollm2-135m"


def requests_with(data: bytes, model: str | None, aliases: dict[str, str]) -> list[Request]:
    report, recs = validate(data, None, model, aliases=aliases)
    assert report.invalid == 0, [str(e) for e in report.errors]
    return [Request.model_validate(orjson.loads(r[JSON_AT:])) for r in recs]
