"""Real OpenAI batch files go through unchanged: every body field OpenAI's chat and completions APIs
accept is used, ignored (cannot change the output) or refused by name with the reason."""

from __future__ import annotations

import orjson
import pytest

from tests.producer.test_validation import errors, requests
from worker.queue.adapter import generation_params

# From OpenAI's Batch API guide and vLLM's offline batch example (the shapes their users keep in files),
# then lines carrying the chat API's other fields.
DOCUMENTED = [
    b'{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    b'"gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful assistant."},'
    b'{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
    b'{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    b'"meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "system", "content": "You are an '
    b'unhelpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}',
    b'{"custom_id": "request-3", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    b'"gpt-4o-mini", "messages": [{"role": "developer", "content": "Answer in French."}, {"role": "user", '
    b'"content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}], '
    b'"presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"50256": -100, "11": 2.5}, '
    b'"user": "user-1234", "store": false, "metadata": {"project": "nightly"}, "service_tier": "auto", '
    b'"stream": false, "n": 1, "modalities": ["text"], "parallel_tool_calls": true, "seed": 7, '
    b'"temperature": 0.2, "top_p": 0.9, "stop": ["\\n\\n"], "logprobs": true, "top_logprobs": 2}}',
    b'{"custom_id": "request-4", "method": "POST", "url": "/v1/completions", "body": {"model": '
    b'"gpt-3.5-turbo-instruct", "prompt": "Say this is a test", "max_tokens": 7, "temperature": 0, '
    b'"logprobs": 3, "echo": false, "best_of": 1, "user": "u", "frequency_penalty": -1.5}}',
]


def test_documented_openai_lines_are_accepted_and_their_generation_fields_used() -> None:
    r1, r2, r3, r4 = requests(b"\n".join(DOCUMENTED))
    assert r1.params.max_new_tokens == 1000 and r2.params.max_new_tokens == 1000
    assert r3.messages is not None and r3.messages[1].content == "Hello\nworld"  # text parts, joined
    p = r3.params
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (
        0.5,
        0.25,
        {"50256": -100.0, "11": 2.5},
    )
    assert (p.seed, p.temperature, p.top_p, p.stop, p.logprobs, p.top_logprobs) == (
        7,
        0.2,
        0.9,
        ["\n\n"],
        True,
        2,
    )
    assert r3.metadata == {"project": "nightly"}
    assert (
        r4.prompt == "Say this is a test"
        and r4.params.frequency_penalty == -1.5
        and r4.params.top_logprobs == 3
    )

    g = generation_params(p)  # what the engine gets
    assert (g.presence_penalty, g.frequency_penalty) == (0.5, 0.25)
    assert g.logit_bias == ((11, 2.5), (50256, -100.0))  # ids as ints, in id order


def _chat(**body: object) -> bytes:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    return orjson.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": {**base, **body}})


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            "line 1: body: 'tools' is unsupported",
        ),
        (_chat(tool_choice="auto"), "line 1: body: 'tool_choice' is unsupported"),
        (_chat(functions=[{"name": "f"}]), "line 1: body: 'functions' is unsupported"),
        (_chat(audio={"voice": "alloy"}), "line 1: body: 'audio' is unsupported"),
        (
            _chat(modalities=["text", "audio"]),
            "line 1: body: 'modalities' = ['text', 'audio'] is unsupported",
        ),
        (_chat(stream=True), "line 1: body: 'stream' = True is unsupported"),
        (_chat(n=0), "line 1: body.n: Input should be greater than or equal to 1"),
        (_chat(n=3, best_of=2), "line 1: body.best_of: best_of must be >= n: best_of is 2, n is 3"),
        (_chat(prediction={"type": "content", "content": "x"}), "line 1: body: 'prediction' is unsupported"),
        (
            _chat(presence_penalty=2.5),
            "line 1: body.presence_penalty: Input should be less than or equal to 2",
        ),
        (_chat(logit_bias={"abc": 1}), "line 1: body.logit_bias: keys are token ids"),
        (
            _chat(logit_bias={"7": 101}),
            "line 1: body.logit_bias.7: Input should be less than or equal to 100",
        ),
        (_chat(logit_bias={"7": 1, "007": 2}), "line 1: body.logit_bias: a token id is given twice"),
        (
            _chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
            "line 1: body.messages.0.content: content part 0: type 'input_audio' is unsupported",
        ),
        (
            _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
            "line 1: body.messages.0.content.0.image_url.url: unsupported image URL 'u'",
        ),
        (
            orjson.dumps({"url": "/v1/completions", "body": {"prompt": "x", "echo": True}}),
            "line 1: body: 'echo' = True is unsupported",
        ),
        (
            orjson.dumps({"url": "/v1/completions", "body": {"prompt": "x", "suffix": "y"}}),
            "line 1: body: 'suffix' is unsupported",
        ),
        (orjson.dumps({"url": "/v1/responses", "body": {"input": "x"}}), "line 1: url: Input should be"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(line: bytes, expected: str) -> None:
    errs = errors(line)
    assert len(errs) == 1 and errs[0].startswith(expected), errs
