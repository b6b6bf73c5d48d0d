"""What a request asks: its sampling parameters (SamplingParams, with the batch defaults they resolve over),
its output constraints, chat messages, and the Request that travels through the queue.

Pure pydantic: importing this module must never import torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from producer.wire.strict import StrictModel

MAX_STOP_STRINGS = 16
MIN_CHOICES, MAX_CHOICES = 2, 256
MAX_LABEL_CHARS = 512
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
MAX_SAMPLES = 128  # n and best_of (OpenAI's cap on n)
TruncateSide = Literal["left", "right"]


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: a named JSON Schema the output must satisfy."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    name: str = Field(default="schema", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only allowed with it")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` shape; folded into choices / regex / response_format on validation."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    choice: list[str] | None = None
    regex: str | None = None
    json_: dict[str, Any] | None = Field(default=None, alias="json")


class SamplingParams(StrictModel):
    """Per-request generation parameters. Every field is optional: None means "use the batch default".

    `resolve()` merges them over the batch defaults and BUILTIN_DEFAULTS; what is still unset then takes
    the engine's default.
    Strict types: JSON `true` is not a token count and `"0.5"` is not a temperature.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        validation_alias=AliasChoices("max_new_tokens", "max_tokens", "max_completion_tokens"),
    )
    # allow_inf_nan=False: finite numbers only, checked inside pydantic-core (a Python validator here cost
    # a call per field per line on the submit path).
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    # OpenAI: {"token id": bias}, the id written as a string (JSON keys are); bias in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    timeout_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    truncate_prompt: TruncateSide | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)  # samples returned
    best_of: int | None = Field(
        default=None, ge=1, le=MAX_SAMPLES
    )  # samples generated; the n likeliest return
    # Labeling outputs. At most one output constraint: choices, response_format (json) or regex.
    choices: list[str] | None = Field(default=None, validation_alias=AliasChoices("choices", "guided_choice"))
    response_format: ResponseFormat | None = None
    regex: str | None = Field(
        default=None, min_length=1, validation_alias=AliasChoices("regex", "guided_regex")
    )
    structured_outputs: StructuredOutputs | None = None  # input only: folded into the three above
    logprobs: bool | int | None = None  # OpenAI's bool, or vLLM's top-k count
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Reasoning models (chat requests): a thinking budget, after which the end of thinking is forced; extra
    # variables for the chat template ({"enable_thinking": false}); OpenAI's reasoning_effort, passed to the
    # template as `reasoning_effort` (gpt-oss's reads it; others ignore it)
    max_reasoning_tokens: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return None
        taken = sorted(RESERVED_TEMPLATE_KWARGS & v.keys())
        if taken:
            raise ValueError(
                f"{', '.join(taken)}: apply_chat_template's own argument(s), not template variables"
            )
        for k in v:
            if not k.isidentifier():
                raise ValueError(f"template variable names are identifiers, got {k[:40]!r}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_rules(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        for s in v:
            if s == "":
                raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids may be biased, got {len(v)}")
        for k in v:
            if not (k.isascii() and k.isdigit()) or len(k) > 10:
                raise ValueError(f"keys are token ids written as decimal strings, got {k[:20]!r}")
        if len({int(k) for k in v}) != len(v):
            raise ValueError("a token id is given twice (as two spellings of one number)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        check_samples(info.data.get("n"), v)
        return v

    @model_validator(mode="after")
    def _labeling_outputs(self) -> SamplingParams:
        if self.structured_outputs is not None:
            self._fold_structured_outputs(self.structured_outputs)
        if self.logprobs is not None and not isinstance(self.logprobs, bool):  # vLLM: logprobs=k
            k = self.logprobs
            if not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"logprobs as a count must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
            if self.top_logprobs is not None and self.top_logprobs != k:
                raise ValueError(f"logprobs={k} and top_logprobs={self.top_logprobs} disagree")
            self.logprobs, self.top_logprobs = True, k
        if self.top_logprobs and self.logprobs is not True:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format is not None and self.response_format.type == "text":
            self.response_format = None  # plain text is no constraint
        if self.choices is not None:
            _check_choices(self.choices)
        given = [k for k in ("choices", "response_format", "regex") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of choices, response_format and regex, got {', '.join(given)}"
            )
        return self

    def _fold_structured_outputs(self, so: StructuredOutputs) -> None:
        given = [
            (k, v)
            for k, v in (("choice", so.choice), ("regex", so.regex), ("json", so.json_))
            if v is not None
        ]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of choice, regex, json")
        if self.choices is not None or self.response_format is not None or self.regex is not None:
            raise ValueError("structured_outputs and choices/response_format/regex are given together")
        if so.choice is not None:
            self.choices = list(so.choice)
        elif so.regex is not None:
            self.regex = so.regex
        else:
            self.response_format = ResponseFormat.model_validate(
                {"type": "json_schema", "json_schema": {"schema": so.json_}}
            )
        self.structured_outputs = None

    def resolve(self, defaults: SamplingParams | None = None) -> SamplingParams:
        """Fill every unset field from `defaults`, then from the built-in defaults."""
        return SamplingParams.model_validate(self.params_over(defaults_base(defaults)))

    def params_over(self, base: dict[str, Any]) -> dict[str, Any]:
        """The resolved parameters as a plain dict, for serialising: `base` overridden by the fields set here.

        Not validated again: both sides already were (this instance, and the batch defaults in `base`).
        Submit takes this path once per line, where a second pydantic pass cost a third of the time.
        Reads the fields straight from the instance: an input line subclasses SamplingParams, so this
        also takes the parameters out of a whole line. Shares `base`'s lists: serialise, don't mutate.
        """
        merged = dict(base)
        fields = self.__dict__
        if (
            fields["choices"] is not None
            or fields["response_format"] is not None
            or fields["regex"] is not None
        ):
            for k in _CONSTRAINTS:  # a line's output constraint replaces the batch's as a whole
                merged.pop(k, None)
        for k in _RESOLVED_FIELDS:
            v = fields[k]
            if v is not None:
                merged[k] = v.model_dump(by_alias=True, exclude_none=True) if isinstance(v, BaseModel) else v
        if "choices" in merged and "temperature" not in merged:
            merged["temperature"] = CHOICES_TEMPERATURE
        if fields["chat_template_kwargs"] is not None and base.get("chat_template_kwargs"):
            # the line's template variables over the batch's, key by key (vLLM merges its defaults so)
            merged["chat_template_kwargs"] = {
                **base["chat_template_kwargs"],
                **fields["chat_template_kwargs"],
            }
        return merged


def defaults_base(defaults: SamplingParams | None) -> dict[str, Any]:
    """The built-in defaults overridden by the set fields of `defaults` (the batch's defaults)."""
    base = dict(BUILTIN_DEFAULTS)
    if defaults is not None:
        base.update(defaults.model_dump(by_alias=True, exclude_none=True, exclude={"structured_outputs"}))
    return base


def check_samples(n: int | None, best_of: int | None) -> None:
    """best_of generates the samples that n returns: it cannot be fewer (OpenAI's and vLLM's rule)."""
    if best_of is not None and best_of < (n or 1):
        raise ValueError(f"best_of must be >= n: best_of is {best_of}, n is {n or 1}")


def _check_choices(choices: list[str]) -> None:
    if not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"choices needs {MIN_CHOICES} to {MAX_CHOICES} labels, got {len(choices)}")
    seen: set[str] = set()
    for label in choices:
        if not label:
            raise ValueError("choices must be non-empty strings")
        if len(label) > MAX_LABEL_CHARS:
            raise ValueError(f"a choice is longer than {MAX_LABEL_CHARS} characters: {label[:40]!r}...")
        if label in seen:
            raise ValueError(f"choices must be distinct: {label!r} appears twice")
        seen.add(label)


# What a request gets when neither its line nor the batch sets it. Only max_new_tokens is resolved here
# (the queue orders a batch by it); every other unset field takes the engine's neutral default
# (worker/engine/params.py: temperature 1, no filtering, no penalty, no stop strings, no timeout).
BUILTIN_DEFAULTS: dict[str, Any] = {"max_new_tokens": 256}
# A labeling request (`choices`) that sets no temperature (neither on its line nor in the batch defaults)
# answers with its arg-max label: sampling a label at the engine's default temperature of 1 would flip
# rows between two runs of the same file. Its label_scores are the same either way.
CHOICES_TEMPERATURE = 0.0


class TextPart(StrictModel):
    """OpenAI's text content part."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ImageUrl(StrictModel):
    """Where an image part's image is: a data: URL, a file:// path or an http(s) URL as a user writes it,
    and on the queue a reference to the image submit stored (producer/wire/images.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(min_length=1)
    # OpenAI's resolution hint: its default, "auto", is what batchq does (each image at its model's image
    # processor's resolution); "low" and "high" would ask for another, which batchq cannot honour
    detail: Literal["auto"] | None = None

    @field_validator("detail", mode="before")
    @classmethod
    def _auto_only(cls, v: Any) -> Any:
        if v is not None and v != "auto":
            raise ValueError(f"detail {v!r} is unsupported: each image is seen at its model's image processor's "
                             "resolution; leave detail out or give 'auto'")  # fmt: skip
        return v


class ImagePart(StrictModel):
    """OpenAI's image content part: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["image_url"]
    image_url: ImageUrl


CONTENT_PART_TYPES = ("text", "image_url")


def _tag(kind: str) -> str:
    # Tags of the content unions appear in pydantic's error locations; their angle brackets let field_path
    # drop them, so an error names the field as the user wrote it (messages.0.content.1.image_url.url).
    return f"<{kind}>"


def _part_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return _tag(kind) if kind in CONTENT_PART_TYPES else None


def _content_tag(v: Any) -> str:
    return _tag("parts") if isinstance(v, list) else _tag("text")


ContentPart = Annotated[
    Annotated[TextPart, Tag(_tag("text"))] | Annotated[ImagePart, Tag(_tag("image_url"))],
    Discriminator(_part_tag),
]


def field_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """A pydantic error location as the path of the field the user wrote: the content unions' tags left out."""
    return tuple(p for p in loc if not (isinstance(p, str) and p.startswith("<") and p.endswith(">")))


def field_path(loc: tuple[str | int, ...]) -> str:
    """field_loc, dotted: messages.0.content.1.image_url.url."""
    return ".".join(map(str, field_loc(loc)))


class ChatMessage(StrictModel):
    """A chat message. `content` may also come as OpenAI's list of content parts: text and image_url parts.
    A list of text parts alone is joined with newlines into one string (as vLLM does), so a text-only
    message is a string whichever way it was written; a message with an image keeps its parts, in order.
    Any other part (audio, file) is refused by its type."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[
        Annotated[str, Tag(_tag("text"))] | Annotated[list[ContentPart], Tag(_tag("parts"))],
        Discriminator(_content_tag),
    ]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in CONTENT_PART_TYPES:
                what = f"type {kind!r}" if kind is not None else "a part without a type"
                raise ValueError(f"content part {i}: {what} is unsupported (text and image_url parts only)")
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                return v  # an image, or a malformed text part: validated part by part, errors by path
            texts.append(part["text"])
        return "\n".join(texts)

    @property
    def has_images(self) -> bool:
        return not isinstance(self.content, str)


EncodingFormat = Literal["float", "base64"]


class EmbeddingRequest(StrictModel):
    """An embedding request on the wire: its inputs, always a list (texts, or token-id lists), one vector
    each; the leading `dimensions` kept (Matryoshka); `encoding_format` of the vectors in the result."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: list[str] | list[list[int]]
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: EncodingFormat = "float"


class Request(StrictModel):
    """One request as it travels through the queue (the arq job's only argument, as a dict).

    Exactly one of `prompt` / `messages` / `embedding` is set. `params` are already resolved against the
    batch defaults (an embedding request's hold max_new_tokens 1, timeout_s and truncate_prompt only).
    """

    batch_id: str
    id: str
    index: int = Field(ge=0, description="0-based position in the batch, used for ordering results")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    embedding: EmbeddingRequest | None = None
    params: SamplingParams
    metadata: dict[str, Any] | None = None
    model: str | None = None
    lora: str | None = None  # the LoRA adapter that runs it (or `model` names one the worker serves)
    enqueued_at: float = 0.0
    result_cache: bool = True  # False: compute afresh even when the result cache holds the answer
    attempt: int = Field(default=0, ge=0)  # 0: as submitted; n: the n-th `producer retry` of this request

    @model_validator(mode="after")
    def _one_input(self) -> Request:
        if self.embedding is not None:
            if self.prompt is not None or self.messages is not None:
                raise ValueError("an embedding request has no 'prompt' or 'messages'")
        elif (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is required")
        if self.prompt is not None and self.prompt == "":
            raise ValueError("prompt must be non-empty")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("messages must be a non-empty list")
        if self.params.max_new_tokens is None:
            raise ValueError("params.max_new_tokens must be set (submit resolves it)")
        return self


# structured_outputs is folded into the constraint fields on validation.
_RESOLVED_FIELDS = tuple(k for k in SamplingParams.model_fields if k != "structured_outputs")
_CONSTRAINTS = ("choices", "response_format", "regex")
