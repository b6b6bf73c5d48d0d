"""Results as OpenAI Batch API output lines, for pipelines written against that format."""

from __future__ import annotations

import time
from typing import Any

import orjson

from producer.wire import keys
from producer.wire.results import Completion, Result, TokenLogprob

# OpenAI knows only "stop" and "length": a timeout or a repetition cut truncates output like a length limit.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "repetition": "length"}


def output_model_and_created(meta: dict[str, str]) -> tuple[str, int]:
    """`created` of a batch's output lines, and the `model` a line names when its result does not say which
    model answered it (results stored before results named their model), from its batchq meta."""
    model = meta.get("model") or meta.get("body_model") or "unknown"
    created = int(float(meta.get("finished_at") or meta.get("created_at") or time.time()))
    return model, created


# batchq error type -> (HTTP status, OpenAI error type, param) of the line's response. Anything else is the
# server's fault (a worker died on it, an engine error): 500, server_error.
_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_request": (400, "invalid_request_error", None),
    "prompt_too_long": (400, "invalid_request_error", "messages"),
    "kv_capacity": (400, "invalid_request_error", "max_tokens"),
    "model_not_found": (404, "invalid_request_error", "model"),
    "context_length_exceeded": (400, "invalid_request_error", "max_tokens"),
    "invalid_schema": (400, "invalid_request_error", "response_format"),
    "invalid_regex": (400, "invalid_request_error", "regex"),
    "invalid_choices": (400, "invalid_request_error", "choices"),
    # an image the worker cannot have (worker/queue/images.py): expired, unreachable, or not to be fetched
    "image_not_found": (400, "invalid_request_error", "messages"),
    "image_fetch_failed": (400, "invalid_request_error", "messages"),
    "image_url_refused": (400, "invalid_request_error", "messages"),
    "images_unsupported": (400, "invalid_request_error", "messages"),
}
_SERVER_ERROR = (500, "server_error", None)
_EXPIRED = "This request could not be executed before the completion window expired."


def is_error_line(result: Result) -> bool:
    """Whether the result goes to OpenAI's error file (failed and cancelled requests) or the output file."""
    return result.finish_reason in ("error", "cancelled")


def openai_line(
    result: Result, *, chat: bool, batch_id: str, model: str, created: int, expired: bool = False
) -> bytes:
    """One OpenAI Batch output line. A failed request answers like the API would have: a non-200 response
    whose body is an OpenAI error object (code: batchq's error type); a cancelled one gets no response and
    a top-level error, batch_cancelled (batch_expired when `expired`: the batch ran out of its window)."""
    request_id = keys.job_id(batch_id, result.index)
    line: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": result.id}
    err = result.error
    if result.finish_reason == "cancelled":
        line["response"] = None
        line["error"] = (
            {"code": "batch_expired", "message": _EXPIRED}
            if expired
            else {"code": "batch_cancelled", "message": err.message if err else "the batch was cancelled"}
        )
        return orjson.dumps(line)
    if result.finish_reason == "error":
        etype = err.type if err else "error"
        status, kind, param = _ERRORS.get(etype, _SERVER_ERROR)
        if param == "messages" and not chat:
            param = "prompt"
        body = {
            "message": err.message if err else "request failed",
            "type": kind,
            "param": param,
            "code": etype,
        }
        line["response"] = {"status_code": status, "request_id": request_id, "body": {"error": body}}
        line["error"] = None
        return orjson.dumps(line)
    if result.embeddings is not None:
        line["response"] = {
            "status_code": 200,
            "request_id": request_id,
            "body": embedding_body(result, model),
        }
        line["error"] = None
        return orjson.dumps(line)
    samples = result.choices or [
        Completion(
            index=0,
            text=result.text,
            finish_reason=result.finish_reason,
            logprobs=result.logprobs,
            reasoning_content=result.reasoning_content,
        )
    ]
    choices = [_choice(c, chat) for c in samples]
    usage = result.usage
    details = usage.completion_tokens_details
    reasoning_tokens = details.reasoning_tokens if details is not None else 0
    line["response"] = {
        "status_code": 200,
        "request_id": request_id,
        "body": {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": result.model or model,
            "choices": choices,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens or usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
            },
        },
    }
    line["error"] = None
    return orjson.dumps(line)


def _choice(c: Completion, chat: bool) -> dict[str, Any]:
    """OpenAI's `choices[i]`: one sample's text (as the assistant's message in chat), logprobs, finish."""
    choice: dict[str, Any] = {"index": c.index}
    content = c.logprobs.content if c.logprobs is not None else None
    if chat:
        choice["message"] = {"role": "assistant", "content": c.text}
        if c.reasoning_content is not None:  # vLLM's field for a reasoning model's thinking
            choice["message"]["reasoning_content"] = c.reasoning_content
        choice["logprobs"] = None if content is None else {"content": [t.model_dump() for t in content]}
    else:
        choice["text"] = c.text
        choice["logprobs"] = None if content is None else _completion_logprobs(content)
    choice["finish_reason"] = _FINISH[c.finish_reason]
    return choice


def _completion_logprobs(content: list[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, and each position's top alternatives as a dict."""
    offsets, at = [], 0
    for t in content:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in content],
        "token_logprobs": [t.logprob for t in content],
        "top_logprobs": [{c.token: c.logprob for c in t.top_logprobs} for t in content],
        "text_offset": offsets,
    }


def embedding_body(result: Result, model: str) -> dict[str, Any]:
    """OpenAI's embeddings response: one `embedding` object per input, in input order."""
    assert result.embeddings is not None
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(result.embeddings)]
    tokens = result.usage.prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": result.model or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
