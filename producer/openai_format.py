"""Results as OpenAI Batch API output lines, for pipelines written against that format."""

from __future__ import annotations

import time
from typing import Any

import orjson

from producer import keys
from producer.contract import Result, TokenLogprob

# OpenAI knows only "stop" and "length": a timeout or a repetition cut truncates output like a length limit.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "repetition": "length"}


def output_model_and_created(meta: dict[str, str]) -> tuple[str, int]:
    """`model` and `created` of a batch's output lines, from its batchq meta (store.get_meta)."""
    model = meta.get("model") or meta.get("body_model") or "batchq"
    created = int(float(meta.get("finished_at") or meta.get("created_at") or time.time()))
    return model, created


def openai_line(result: Result, *, chat: bool, batch_id: str, model: str, created: int) -> bytes:
    request_id = keys.job_id(batch_id, result.index)
    line: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": result.id}
    if result.finish_reason in ("error", "cancelled"):
        err = result.error
        line["response"] = None
        line["error"] = {
            "code": err.type if err else result.finish_reason,
            "message": err.message if err else result.finish_reason,
        }
        return orjson.dumps(line)
    choice: dict[str, Any] = {"index": 0}
    content = result.logprobs.content if result.logprobs is not None else None
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text}
        choice["logprobs"] = None if content is None else {"content": [t.model_dump() for t in content]}
    else:
        choice["text"] = result.text
        choice["logprobs"] = None if content is None else _completion_logprobs(content)
    choice["finish_reason"] = _FINISH[result.finish_reason]
    usage = result.usage
    line["response"] = {
        "status_code": 200,
        "request_id": request_id,
        "body": {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens or usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
            },
        },
    }
    line["error"] = None
    return orjson.dumps(line)


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
