"""Typed objects crossing the engine boundary: a request in, a result out, a stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from worker.engine.params import GenerationParams

FinishReason = Literal["eos", "stop", "length", "timeout", "repetition", "cancelled", "error"]


@dataclass(frozen=True)
class EngineRequest:
    """One generation request. Exactly one of prompt / messages / prompt_token_ids is set.

    `messages` are chat messages ({"role", "content"}, rendered with the model's chat template).
    `started_at` is time.monotonic() when the caller picked the request up; timeout_s counts from
    there (default: the moment the engine receives it).
    """

    request_id: str
    params: GenerationParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    started_at: float | None = None


@dataclass(frozen=True)
class EngineError:
    type: str  # invalid_request, prompt_too_long, kv_capacity, engine_error, ...
    message: str


@dataclass(frozen=True)
class EngineResult:
    request_id: str
    text: str
    token_ids: list[int]  # every generated token, a final EOS / stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # None when no token was generated
    total_s: float
    error: EngineError | None = None  # set exactly when finish_reason is "error"
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    prompt_tokens: int  # of the requests prefilled so far
    cached_prompt_tokens: int  # of prompt_tokens, served from the prefix cache (not computed)
    steps: int
    prefill_steps: int
    prefill_s: float  # time in the model for prefill steps
    decode_s: float  # time in the model for decode steps
