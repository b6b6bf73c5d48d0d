"""The one place where the wire contract (producer/wire/request_params.py, results.py) and the engine's own
types meet.

A queued Request becomes an EngineRequest with fully resolved GenerationParams; an EngineResult becomes
the stored Result. Fields a request leaves unset take the engine's defaults (GenerationParams);
max_new_tokens is always set (submit resolves it, and the contract's Request checks it).
"""

from __future__ import annotations

import base64
import sys
import time
from array import array
from collections.abc import Mapping
from typing import Any

import orjson

from producer.wire.request_params import CHOICES_TEMPERATURE, ChatMessage, Request, SamplingParams, TextPart
from producer.wire.results import (
    ChoiceLogprobs,
    Completion,
    ErrorInfo,
    LabelScore,
    Result,
    Timing,
    TopLogprob,
    Usage,
)
from producer.wire.results import TokenLogprob as ContractTokenLogprob
from worker.engine.params import NO_CONSTRAINT, Constraint, GenerationParams
from worker.engine.request import EmbeddingInputs, EngineRequest, EngineResult, TokenLogprob
from worker.queue.images import ImageError

# Contract fields with another type in the engine; every other field keeps its name and value.
_TUPLES = ("stop", "stop_token_ids", "choices")
_CONSTRAINT = ("response_format", "regex")  # -> the engine's one `constraint`
# structured_outputs is folded into the constraint fields by the contract; the template's variables go with
# the request (chat_template_kwargs, reasoning_effort among them).
_NOT_PARAMS = ("structured_outputs", "chat_template_kwargs", "reasoning_effort")


def generation_params(params: SamplingParams) -> GenerationParams:
    """The engine's parameters for a request: the fields it sets, the engine's defaults for the rest."""
    given: dict[str, Any] = params.model_dump(exclude_none=True, exclude={*_NOT_PARAMS, *_CONSTRAINT})
    for k in _TUPLES:
        if k in given:
            given[k] = tuple(given[k])
    if "logit_bias" in given:  # OpenAI's {"id": bias} -> ((id, bias), ...) in id order
        given["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in given["logit_bias"].items()))
    if "choices" in given and "temperature" not in given:  # submit resolves it; older payloads may not
        given["temperature"] = CHOICES_TEMPERATURE
    given["constraint"] = constraint(params)
    return GenerationParams(**given)


def constraint(params: SamplingParams) -> Constraint:
    """response_format (json_object: any JSON object) or regex as the engine's grammar constraint."""
    fmt = params.response_format
    if fmt is not None:
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else {"type": "object"}
        return Constraint(
            "json_schema", orjson.dumps(schema).decode()
        )  # key order kept: it orders the output
    if params.regex is not None:
        return Constraint("regex", params.regex)
    return NO_CONSTRAINT


def engine_request(
    req: Request,
    request_id: str,
    lora: str | None = None,
    images: Mapping[str, bytes | ImageError] | None = None,
) -> EngineRequest:
    """`request_id` is the job id (unique across batches); the request's clock starts now. lora: the LoRA
    adapter that runs it (None: the base model). `images`: the bytes of the request's image parts by url
    (worker/queue/images.py); raises the ImageError of one that cannot be had."""
    emb = req.embedding
    messages, shown = engine_messages(req.messages, images or {}) if req.messages else (None, None)
    return EngineRequest(
        request_id=request_id,
        params=generation_params(req.params),
        prompt=req.prompt,
        messages=messages,
        started_at=time.monotonic(),
        chat_template_kwargs=template_kwargs(req.params),
        embedding=None if emb is None else EmbeddingInputs(emb.input, emb.dimensions),
        lora=lora,
        images=shown,
    )


def engine_messages(
    messages: list[ChatMessage], images: Mapping[str, bytes | ImageError]
) -> tuple[list[dict[str, Any]], list[bytes] | None]:
    """The messages as the engine takes them, and their images' bytes in the order their parts appear. A
    text-only message is {"role", "content": str} exactly as ever (its template rendering and cache key
    stay); a message with images has its parts, an image as {"type": "image"}, the placeholder HF chat
    templates render."""
    out: list[dict[str, Any]] = []
    shown: list[bytes] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append(m.model_dump(exclude_none=True))
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(m.content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            data = images.get(part.image_url.url)
            if isinstance(data, ImageError):
                raise ImageError(data.error_type, f"messages.{i}.content.{j}.image_url.url: {data}")
            if data is None:
                raise ImageError(
                    "invalid_request",
                    f"messages.{i}.content.{j}.image_url.url: not an image submit stored "
                    f"({part.image_url.url[:40]!r}...): submit the batch with producer submit",
                )
            shown.append(data)
            parts.append({"type": "image"})
        out.append({**m.model_dump(exclude_none=True, exclude={"content"}), "content": parts})
    return out, shown or None


def template_kwargs(params: SamplingParams) -> dict[str, Any] | None:
    """The chat template's extra variables: chat_template_kwargs, and reasoning_effort by that name (a
    variable of its own set in chat_template_kwargs wins, as the more specific)."""
    given = dict(params.chat_template_kwargs or {})
    if params.reasoning_effort is not None:
        given.setdefault("reasoning_effort", params.reasoning_effort)
    return given or None


def to_result(
    req: Request,
    res: EngineResult,
    queued_s: float | None,
    worker_id: str,
    model: str,
    dtype: str | None = None,
    batch_invariant: bool | None = None,
) -> Result:
    """`model`: the model the worker serves, which computed the result; dtype, batch_invariant: its engine's
    arithmetic (Engine.dtype_name, Engine.batch_invariant)."""
    error = None if res.error is None else ErrorInfo(type=res.error.type, message=res.error.message)
    return Result(
        id=req.id,
        index=req.index,
        text=res.text,
        reasoning_content=res.reasoning_content,
        finish_reason=res.finish_reason,
        usage=Usage.counted(
            res.prompt_tokens,
            res.completion_tokens,
            res.cached_tokens,
            None if res.reasoning_content is None else res.reasoning_tokens,
        ),
        timing=Timing(queued_s=queued_s, ttft_s=res.ttft_s, total_s=res.total_s),
        error=error,
        metadata=req.metadata,
        model=model,
        dtype=dtype,
        batch_invariant=batch_invariant,
        worker=worker_id,
        label_scores=None if res.label_scores is None else [LabelScore(**vars(s)) for s in res.label_scores],
        logprobs=_logprobs(res.logprobs),
        embeddings=_embeddings(req, res),
        warnings=_warnings(req, res),
        **_samples(req, res),
    )


def _warnings(req: Request, res: EngineResult) -> list[str] | None:
    """What the request set that the model did not apply: the reasoning fields of a chat request on a model
    without reasoning markers. The engine splits every chat request of a model with markers, and its result
    then carries reasoning_content (at least ""; Sequence.to_result): None says no parser ran. (A raw
    prompt's reasoning fields come from the batch's defaults, which leave prompt lines alone by design.)"""
    p = req.params
    asked = [k for k in ("max_reasoning_tokens", "reasoning_effort") if getattr(p, k) is not None]
    if not asked or req.messages is None or res.error is not None or res.reasoning_content is not None:
        return None
    return [f"{' and '.join(asked)} ignored: the model has no reasoning markers"]


def _logprobs(rows: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    return None if rows is None else ChoiceLogprobs(content=[_token(t) for t in rows])


def _samples(req: Request, res: EngineResult) -> dict[str, Any]:
    """n > 1: every sample returned as `choices`, and with `choices` labels the vote over them."""
    if res.samples is None:
        return {}
    choices = [
        Completion(index=i, text=s.text, finish_reason=s.finish_reason, completion_tokens=s.completion_tokens,
                   logprobs=_logprobs(s.logprobs), reasoning_content=s.reasoning_content)
        for i, s in enumerate(res.samples)
    ]  # fmt: skip
    if not req.params.choices:
        return {"choices": choices}
    vote = dict.fromkeys(req.params.choices, 0)
    for c in choices:
        vote[c.text] += 1
    return {"choices": choices, "vote": vote, "agreement": max(vote.values()) / len(choices)}


def _embeddings(req: Request, res: EngineResult) -> list[list[float]] | list[str] | None:
    """The vectors as the request asked them written: floats, or base64 of little-endian float32."""
    if res.embeddings is None or req.embedding is None:
        return None
    if req.embedding.encoding_format == "float":
        return res.embeddings
    return [base64_float32(v) for v in res.embeddings]


def base64_float32(vector: list[float]) -> str:
    """OpenAI's base64 embedding: the vector's float32 values, little-endian, base64-encoded."""
    packed = array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _token(t: TokenLogprob) -> ContractTokenLogprob:
    top = [TopLogprob(token=c.token, logprob=c.logprob, bytes=c.bytes) for c in t.top]
    return ContractTokenLogprob(token=t.token, logprob=t.logprob, bytes=t.bytes, top_logprobs=top)


def error_result(rid: str, index: int, etype: str, message: str, req: Request | None = None) -> Result:
    """A request that never reached the engine (invalid payload, too many tries, wrong model)."""
    return Result(
        id=rid,
        index=index,
        finish_reason="error",
        error=ErrorInfo(type=etype, message=message),
        metadata=req.metadata if req else None,
    )


def cancelled_result(req: Request) -> Result:
    return Result(id=req.id, index=req.index, finish_reason="cancelled", metadata=req.metadata)
