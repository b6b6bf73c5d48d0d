"""Reasoning-model fields on the producer side, without Redis: chat_template_kwargs, reasoning_effort and
max_reasoning_tokens as lines, OpenAI bodies and batch defaults give them; each bad value refused by line and
field; reasoning_content and reasoning_tokens in the JSONL result and the OpenAI output line."""

from __future__ import annotations

import orjson
import pytest

from producer.cli.commands import InputError, _defaults
from producer.cli.parser import build_parser
from producer.client.openai_format import openai_line
from producer.wire.request_params import Request, SamplingParams
from producer.wire.results import Result, Usage
from tests.producer.test_validation import errors, requests
from worker.queue.adapter import engine_request, template_kwargs

CHAT = b'"messages": [{"role": "user", "content": "hi"}]'


def test_lines_and_openai_bodies_carry_the_fields_to_the_request() -> None:
    data = b"\n".join(
        [
            b'{"id": "a", ' + CHAT + b', "chat_template_kwargs": {"enable_thinking": false}, '
            b'"max_reasoning_tokens": 64}',
            b'{"custom_id": "b", "url": "/v1/chat/completions", "body": {' + CHAT + b", "
            b'"reasoning_effort": "low", "chat_template_kwargs": {"x": 1}}}',
        ]
    )
    a, b = requests(data)
    assert a.params.chat_template_kwargs == {"enable_thinking": False} and a.params.max_reasoning_tokens == 64
    assert b.params.reasoning_effort == "low"
    # the engine's request: the template's variables, reasoning_effort among them
    assert engine_request(b, "job").chat_template_kwargs == {"x": 1, "reasoning_effort": "low"}
    assert engine_request(a, "job").params.max_reasoning_tokens == 64


def test_a_lines_template_variables_go_over_the_batchs_key_by_key() -> None:
    defaults = SamplingParams(
        chat_template_kwargs={"enable_thinking": False, "lang": "en"}, max_reasoning_tokens=8
    )
    data = b'{"id": "a", ' + CHAT + b', "chat_template_kwargs": {"lang": "fr"}}\n{"id": "b", ' + CHAT + b"}"
    a, b = requests(data, defaults)
    assert a.params.chat_template_kwargs == {"enable_thinking": False, "lang": "fr"}
    assert b.params.chat_template_kwargs == {"enable_thinking": False, "lang": "en"}
    assert a.params.max_reasoning_tokens == b.params.max_reasoning_tokens == 8
    # a batch default of them leaves prompt lines alone
    (p,) = requests(b'{"id": "p", "prompt": "x"}', defaults)
    assert p.prompt == "x"


def test_reasoning_effort_wins_over_nothing_but_a_template_variable_of_that_name() -> None:
    p = SamplingParams(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert template_kwargs(p) == {"reasoning_effort": "low"}
    assert template_kwargs(SamplingParams()) is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            b'{"id": "a", ' + CHAT + b', "max_reasoning_tokens": -1}',
            "line 1: max_reasoning_tokens: Input should be greater than or equal to 0",
        ),
        (
            b'{"id": "a", ' + CHAT + b', "max_reasoning_tokens": "8"}',
            "line 1: max_reasoning_tokens: Input should be a valid integer",
        ),
        (
            b'{"id": "a", ' + CHAT + b', "chat_template_kwargs": "enable_thinking"}',
            "line 1: chat_template_kwargs: Input should be a valid dictionary",
        ),
        (
            b'{"id": "a", ' + CHAT + b', "chat_template_kwargs": {"add_generation_prompt": false}}',
            "line 1: chat_template_kwargs: add_generation_prompt: apply_chat_template's own argument",
        ),
        (
            b'{"id": "a", ' + CHAT + b', "chat_template_kwargs": {"not a name": 1}}',
            "line 1: chat_template_kwargs: template variable names are identifiers",
        ),
        (
            b'{"id": "a", ' + CHAT + b', "reasoning_effort": "extreme"}',
            "line 1: reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high' or 'xhigh'",
        ),
        (
            b'{"id": "a", "prompt": "x", "chat_template_kwargs": {"enable_thinking": false}}',
            "line 1: chat_template_kwargs: applies to chat requests (messages) only",
        ),
        (
            b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_reasoning_tokens": 4}}',
            "line 1: body.max_reasoning_tokens: applies to chat requests (messages) only",
        ),
        (
            b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "reasoning_effort": "low"}}',
            "line 1: body.reasoning_effort: applies to chat requests (messages) only",
        ),
    ],
)
def test_each_bad_value_names_line_field_and_reason(line: bytes, expected: str) -> None:
    errs = errors(line)
    assert len(errs) == 1 and errs[0].startswith(expected), errs


def test_submit_flags_set_batch_defaults_and_refuse_bad_values() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["submit", "f.jsonl", "--chat-template-kwargs", '{"enable_thinking": false}', "--max-reasoning-tokens",
         "32", "--reasoning-effort", "medium"]
    )  # fmt: skip
    d = _defaults(args)
    assert (d.chat_template_kwargs, d.max_reasoning_tokens, d.reasoning_effort) == (
        {"enable_thinking": False},
        32,
        "medium",
    )
    for flag, value, message in [
        ("--chat-template-kwargs", "{nope", "--chat-template-kwargs: not JSON"),
        (
            "--chat-template-kwargs",
            '{"tokenize": true}',
            "--chat-template-kwargs: tokenize: apply_chat_template",
        ),
        (
            "--max-reasoning-tokens",
            "-3",
            "--max-reasoning-tokens: Input should be greater than or equal to 0",
        ),
        ("--reasoning-effort", "lots", "--reasoning-effort: Input should be"),
    ]:
        with pytest.raises(InputError, match="^" + message.replace("(", r"\(")):
            _defaults(parser.parse_args(["submit", "f.jsonl", flag, value]))


def reasoning_result(reasoning: str | None) -> Result:
    tokens = None if reasoning is None else 7
    return Result(
        id="r",
        index=0,
        text="positive",
        reasoning_content=reasoning,
        finish_reason="eos",
        usage=Usage.counted(10, 9, 0, tokens),
        model="m",
    )


def test_the_jsonl_result_shows_reasoning_only_where_a_parser_ran() -> None:
    shown = orjson.loads(reasoning_result("it tastes fine").to_user_json())
    assert shown["reasoning_content"] == "it tastes fine"
    assert shown["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}
    plain = orjson.loads(reasoning_result(None).to_user_json())
    assert "reasoning_content" not in plain and "completion_tokens_details" not in plain["usage"]
    assert Result.from_json(reasoning_result("x").to_json()).usage.completion_tokens_details is not None


def test_the_openai_line_has_message_reasoning_content_and_reasoning_tokens() -> None:
    line = orjson.loads(openai_line(reasoning_result("hmm"), chat=True, batch_id="b", model="m", created=1))
    body = line["response"]["body"]
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "positive",
        "reasoning_content": "hmm",
    }
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}
    plain = orjson.loads(openai_line(reasoning_result(None), chat=True, batch_id="b", model="m", created=1))
    assert "reasoning_content" not in plain["response"]["body"]["choices"][0]["message"]
    assert plain["response"]["body"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_request_round_trips_the_fields() -> None:
    req = Request(
        batch_id="b",
        id="a",
        index=0,
        messages=[{"role": "user", "content": "hi"}],  # type: ignore[list-item]
        params=SamplingParams(
            max_new_tokens=4, chat_template_kwargs={"enable_thinking": True}, max_reasoning_tokens=2
        ),
    )
    back = Request.model_validate(orjson.loads(orjson.dumps(req.model_dump(mode="json"))))
    assert (
        back.params.chat_template_kwargs == {"enable_thinking": True}
        and back.params.max_reasoning_tokens == 2
    )
