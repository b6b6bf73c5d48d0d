"""Typed objects crossing the engine boundary: a request in, a result out, a stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from worker.engine.params import GenerationParams

FinishReason = Literal["eos", "stop", "length", "timeout", "repetition", "cancelled", "error"]


@dataclass(frozen=True)
class EmbeddingInputs:
    """What an embedding request embeds: texts (tokenised as a raw prompt is, the tokenizer's special
    tokens included) or token-id lists, one vector each; `dimensions` keeps the first d of the pooled
    hidden state (Matryoshka) before the vector is L2-normalised."""

    inputs: list[str] | list[list[int]]
    dimensions: int | None = None


@dataclass(frozen=True)
class EngineRequest:
    """One generation request. Exactly one of prompt / messages / prompt_token_ids / embedding is set.

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
    # Extra variables of the chat template (e.g. {"enable_thinking": False}, {"reasoning_effort": "low"});
    # a template that does not use one ignores it
    chat_template_kwargs: dict[str, Any] | None = None
    # An embedding request: prefill only (no decode, no sampling), one pooled vector per input
    embedding: EmbeddingInputs | None = None
    # the LoRA adapter (EngineConfig.lora, lora_dir) that runs it; None: the base model
    lora: str | None = None
    # A chat request's images: their encoded bytes as given (PNG, JPEG, ...), one per {"type": "image"} part
    # of `messages`, in the order the parts appear across the messages. A message with images has `content`
    # as a list of {"type": "text", "text"} and {"type": "image"} parts; any other message a string.
    images: list[bytes] | None = None


class RequestError(ValueError):
    """A request the engine refuses, alone: it ends with finish_reason "error" and this type and message."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


@dataclass(frozen=True)
class EngineError:
    type: str  # invalid_request, prompt_too_long, kv_capacity, engine_error, ...
    message: str


@dataclass(frozen=True)
class LabelScore:
    """A label of a `choices` request: the log-probability of the label's tokens then EOS after the
    prompt (teacher-forced), and its share of the probability over the request's labels."""

    label: str
    logprob: float
    prob: float


@dataclass(frozen=True)
class TokenChoice:
    token: str  # the token's text (U+FFFD where it holds part of a character)
    bytes: list[int]  # its exact bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token (or a `choices` label's teacher-forced token) with its log-probability under the
    model (before temperature, filtering, penalties or grammar) and the most likely alternatives at its
    position."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[TokenChoice]


@dataclass(frozen=True, kw_only=True)
class EngineResult:
    """One request's outcome. Every field is named where a result is built: `Sequence.to_result` for a
    request that became a sequence, `EngineResult.unstarted` for one that never did."""

    request_id: str
    text: str
    token_ids: list[int]  # every generated token, a final EOS / stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (not computed)
    ttft_s: float | None  # None when no token was generated
    total_s: float
    error: EngineError | None  # set exactly when finish_reason is "error"
    label_scores: list[LabelScore] | None  # `choices` requests, in the request's label order
    logprobs: list[TokenLogprob] | None  # `logprobs` requests: every generated token but a final
    # EOS / stop token; a `choices` request: its label's tokens and the EOS, teacher-forced (they sum to
    # the label's score)
    # A reasoning model's chat request (reasoning.py): its thinking, apart from `text` (None: no parser ran),
    # and the tokens generated before the answer (of completion_tokens; markers included)
    reasoning_content: str | None = None
    reasoning_tokens: int = 0
    # n > 1: the samples returned, best first under best_of (their own text, tokens, finish reason and
    # logprobs); the fields above are then the request's: its first sample's, usage over every sample
    samples: list[EngineResult] | None = None
    embeddings: list[list[float]] | None = None  # an embedding request: one unit vector per input, in order

    @classmethod
    def unstarted(
        cls, request_id: str, reason: FinishReason, total_s: float, error: EngineError | None = None
    ) -> EngineResult:
        """A request that never became a sequence (cancelled before it ran, or refused): nothing generated."""
        return cls(
            request_id=request_id,
            text="",
            token_ids=[],
            finish_reason=reason,
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            ttft_s=None,
            total_s=total_s,
            error=error,
            label_scores=None,
            logprobs=None,
        )


@dataclass
class EngineCounters:
    """What the engine counts as it runs, cumulative since load: one object, updated in place by the
    engine's thread and copied into each EngineStats snapshot."""

    tokens_generated: int = 0
    prompt_tokens: int = 0  # of the requests prefilled so far
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from the prefix cache (not computed)
    steps: int = 0
    prefill_steps: int = 0
    prefill_s: float = 0.0  # time in the model for prefill steps
    decode_s: float = 0.0  # time in the model for decode steps
    score_steps: int = 0  # `choices` scoring steps (label rows only; in `steps`, not in prefill_steps)
    score_s: float = 0.0  # time in the model for scoring steps
    prefill_tokens: int = 0  # prompt tokens computed in prompt chunks (a preempted one's recomputation too)
    overlapped_steps: int = 0  # decode steps launched before the one before them was taken (async scheduling)


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
    preemptions: int  # sequences whose blocks were taken back when the pool ran out (optimistic admission)
    prefill_s: float  # time in the model for prefill steps
    decode_s: float  # time in the model for decode steps
    score_steps: int = 0  # `choices` scoring steps (label rows only; in `steps`, not in prefill_steps)
    score_s: float = 0.0  # time in the model for scoring steps
    # A model windowed in every layer: blocks the window released as sequences advanced, since load. A model
    # with windowed and full-attention layers: blocks held now that only its full-attention layers read
    # (block_manager.py says why they stay).
    window_released_blocks: int = 0
    window_idle_blocks: int = 0
    prefill_tokens: int = 0  # prompt tokens computed in prompt chunks (a preempted one's recomputation too)
    overlapped_steps: int = 0  # decode steps launched before the one before them was taken (async scheduling)
    # A mixture-of-experts model: per layer with experts (its index), the (token, pick) routings each expert
    # received since load, prompts and generated tokens alike (a skewed batch shows as a few hot experts).
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)
