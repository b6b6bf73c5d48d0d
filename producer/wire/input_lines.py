"""What a user may write on one JSONL input line (docs/architecture.md, "Input"): batchq's prompt and
embedding lines, and OpenAI Batch API lines to /v1/chat/completions, /v1/completions and /v1/embeddings.

A prompt line is SamplingParams (producer/wire/request_params.py) with a line's own fields added;
producer/client/jsonl.py turns a validated line into a request record.
Pure pydantic: importing this module must never import torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from producer.wire.request_params import ChatMessage, EncodingFormat, SamplingParams, TruncateSide
from producer.wire.strict import StrictModel

MAX_ID_CHARS = 512
UserId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request


class PromptLine(SamplingParams):
    """Shapes 1 and 2: `{"id", "prompt" | "messages", <params>, "metadata"}`; params sit at the top level."""

    id: UserId | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    metadata: dict[str, Any] | None = None
    # the LoRA adapter that runs it (a name the queue's workers serve: worker --lora / --lora-dir); an
    # OpenAI line names it in body.model instead
    lora: str | None = Field(default=None, min_length=1)


# Body fields of OpenAI's chat / completions APIs that do not change what a batch generates: accepted
# and ignored (prompt_cache_key, service_tier, ... are routing and billing hints of OpenAI's service).
OPENAI_IGNORED = frozenset({
    "user", "store", "service_tier", "stream_options", "prompt_cache_key", "safety_identifier",
    "parallel_tool_calls", "verbosity",
})  # fmt: skip
# Fields batchq cannot honour: refused with the reason, never silently dropped.
OPENAI_UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "insertion (suffix) is not supported",
}


class OpenAIBody(SamplingParams):
    """The `body` of an OpenAI Batch line. `model` names the model the line is for: a worker serving
    another model answers it with error model_not_found, unless `--model-alias` maps the name.

    Every field OpenAI's chat and completions APIs accept is either used (the sampling parameters,
    response_format, logprobs, ...), ignored because it cannot change the output (OPENAI_IGNORED), or
    refused by name with the reason (OPENAI_UNSUPPORTED, modalities other than text, stream: true,
    echo: true).
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _openai_only_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, why in OPENAI_UNSUPPORTED.items():
            if data.get(key) is not None:
                raise ValueError(f"'{key}' is unsupported: {why} (batchq generates text)")
        refused = {
            "modalities": data.get("modalities") not in (None, ["text"]),
            "stream": data.get("stream") not in (None, False),
            "echo": data.get("echo") not in (None, False),
        }
        for key, bad in refused.items():
            if bad:
                raise ValueError(f"'{key}' = {data[key]!r} is unsupported (a batch answers with text, once)")
        drop = OPENAI_IGNORED | refused.keys()
        return {k: v for k, v in data.items() if k not in drop}


class OpenAIBatchLine(StrictModel):
    """Shape 3: an OpenAI Batch API input line."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: UserId | None = None
    method: Literal["POST"] = "POST"
    url: Literal[
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
    ]  # (embeddings: OpenAIEmbeddingLine)
    body: OpenAIBody
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _body_matches_url(self) -> OpenAIBatchLine:
        if self.url == CHAT_URL and self.body.messages is None:
            raise ValueError(f"{CHAT_URL} needs body.messages")
        if self.url == COMPLETIONS_URL and self.body.prompt is None:
            raise ValueError(f"{COMPLETIONS_URL} needs body.prompt")
        if self.metadata is not None and self.body.metadata is not None:
            raise ValueError("metadata given both on the line and in body; give it once")
        return self


class EmbeddingFields(StrictModel):
    """What an embedding line asks, as OpenAI's embeddings API takes it: `input` is a string, a list of
    strings, a list of token ids or a list of token-id lists (at most MAX_EMBEDDING_INPUTS inputs, none
    empty); `dimensions`, `encoding_format`; and batchq's timeout_s and truncate_prompt."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    input: list[str] | list[list[int]]
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: EncodingFormat | None = None
    timeout_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    truncate_prompt: TruncateSide | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        what = "a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(v, str):
            v = [v]
        elif not isinstance(v, list):
            raise ValueError(f"input must be {what}, got {type(v).__name__}")
        elif v and all(_token_id(t) for t in v):
            v = [v]  # one input given as token ids
        if not v:
            raise ValueError("input must not be empty")
        if len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(v)}")
        texts = all(isinstance(x, str) for x in v)
        if not texts and not all(isinstance(x, list) and all(_token_id(t) for t in x) for x in v):
            raise ValueError(f"input must be {what} (token ids are integers >= 0), not a mix")
        for i, x in enumerate(v):
            if not x:
                raise ValueError(f"input {i} is empty")
        return v

    def embedding(self, encoding_format: EncodingFormat | None = None) -> dict[str, Any]:
        """The wire's EmbeddingRequest fields."""
        fmt = self.encoding_format or encoding_format or "float"
        return {"input": self.input, "dimensions": self.dimensions, "encoding_format": fmt}


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class EmbeddingLine(EmbeddingFields):
    """batchq's embedding line: `{"id", "input", "dimensions", "encoding_format", "metadata", ...}`."""

    id: UserId | None = None
    metadata: dict[str, Any] | None = None
    lora: str | None = Field(default=None, min_length=1)  # as PromptLine's


class OpenAIEmbeddingBody(EmbeddingFields):
    """The `body` of an OpenAI Batch line to /v1/embeddings; `user` is accepted and ignored."""

    model: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None


class OpenAIEmbeddingLine(StrictModel):
    """An OpenAI Batch API input line to /v1/embeddings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: UserId | None = None
    method: Literal["POST"] = "POST"
    url: Literal["/v1/embeddings"]
    body: OpenAIEmbeddingBody
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _metadata_once(self) -> OpenAIEmbeddingLine:
        if self.metadata is not None and self.body.metadata is not None:
            raise ValueError("metadata given both on the line and in body; give it once")
        return self
