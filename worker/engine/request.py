"""Typed objects crossing the engine boundary: a request in, a result out, a stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from producer.contract import FinishReason, SamplingParams


@dataclass
class EngineRequest:
    """One generation request. Exactly one of prompt / messages / prompt_token_ids is set.

    `params` must be resolved (`SamplingParams.resolve()`), so every field is set.
    `started_at` is time.monotonic() when the worker picked it up; timeout_s counts from there
    (default: the moment the engine receives it).
    """

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    started_at: float | None = None


@dataclass
class EngineResult:
    request_id: str
    text: str
    token_ids: list[int]  # every generated token, a final EOS / stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    total_s: float
    error_type: str | None = None
    error_message: str | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_generated: int
    prompt_tokens: int
    steps: int
    prefill_steps: int = 0
    prefill_s: float = 0.0  # time in the model for prefill steps
    decode_s: float = 0.0  # time in the model for decode steps
