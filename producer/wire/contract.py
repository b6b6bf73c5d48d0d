"""The wire contract shared by producer and worker: requests, parameters, results, batch status.

Pure pydantic + orjson. Importing this module must never import torch.
Unknown fields are rejected by name (extra="forbid") everywhere a user writes input.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

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

FinishReason = Literal["eos", "stop", "length", "timeout", "repetition", "cancelled", "error"]
BatchState = Literal["queued", "running", "completed", "cancelled"]
TruncateSide = Literal["left", "right"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=False)


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`: a named JSON Schema the output must satisfy."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    name: str = Field(default="schema", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
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


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` shape; folded into choices / regex / response_format on validation."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    choice: list[str] | None = None
    regex: str | None = None
    json_: dict[str, Any] | None = Field(default=None, alias="json")


class SamplingParams(_Strict):
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


class ChatMessage(_Strict):
    """A chat message. `content` may also come as OpenAI's list of content parts: text parts are joined
    with newlines (as vLLM does); any other part (image, audio, file) is refused by its type."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                what = f"type {kind!r}" if kind is not None else "a part without a type"
                raise ValueError(f"content part {i}: {what} is unsupported (text parts only)")
            texts.append(part["text"])
        return "\n".join(texts)


EncodingFormat = Literal["float", "base64"]
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request


class EmbeddingRequest(_Strict):
    """An embedding request on the wire: its inputs, always a list (texts, or token-id lists), one vector
    each; the leading `dimensions` kept (Matryoshka); `encoding_format` of the vectors in the result."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: list[str] | list[list[int]]
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: EncodingFormat = "float"


class Request(_Strict):
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


class PromptTokensDetails(_Strict):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the worker's prefix cache (not computed)


class CompletionTokensDetails(_Strict):
    reasoning_tokens: int = (
        0  # of completion_tokens, a reasoning model's before its answer (markers included)
    )


class Usage(_Strict):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # set where a reasoning parser ran

    @classmethod
    def counted(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        reasoning_tokens: int | None = None,
    ) -> Usage:
        details = (
            None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=details,
        )


class Timing(_Strict):
    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class ErrorInfo(_Strict):
    type: str
    message: str


class LabelScore(_Strict):
    """A `choices` label's score: logprob = sum of the log-probabilities of its tokens (the label tokenised
    alone) teacher-forced after the prompt, plus the log-probability of the model's first EOS token right
    after them; prob = softmax of the logprobs over the request's labels."""

    label: str
    logprob: float
    prob: float


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Strict):
    """OpenAI's chat logprobs entry for one generated token."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Strict):
    content: list[TokenLogprob] | None = None


class Completion(_Strict):
    """One of the samples of an n > 1 request (Result.choices), as OpenAI's `choices[i]`."""

    index: int = Field(ge=0)
    text: str
    finish_reason: FinishReason
    completion_tokens: int = 0
    logprobs: ChoiceLogprobs | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking in this sample


class Result(_Strict):
    """One result per request; written once, first write wins. An n > 1 request's samples are in
    `choices` (best first under best_of); text, finish_reason and logprobs are then its first's, usage
    counts the prompt once and every generated token, and with `choices` labels `vote` counts the samples
    per label (every label, in request order) and `agreement` is the top label's share of them."""

    id: str
    index: int = Field(ge=0)
    text: str = ""
    reasoning_content: str | None = None  # a reasoning model's thinking, apart from `text` (chat requests)
    finish_reason: FinishReason
    usage: Usage = Field(default_factory=Usage)
    timing: Timing = Field(default_factory=Timing)
    error: ErrorInfo | None = None
    metadata: dict[str, Any] | None = None
    model: str | None = None  # the model that answered (None: no model ran, e.g. an invalid request)
    # the arithmetic that answered (README, What "exact" means): the engine's dtype ("float32", "bfloat16",
    # "float16") and whether its numbers were independent of what shared its steps
    dtype: str | None = None
    batch_invariant: bool | None = None
    worker: str | None = None
    cached: bool = False  # answered from the result cache: the stored answer of an identical request
    label_scores: list[LabelScore] | None = None  # `choices` requests: one per label, in request order
    logprobs: ChoiceLogprobs | None = None  # `logprobs` requests: one entry per generated token
    attempt: int = Field(default=0, ge=0)  # the request's attempt that wrote it (producer retry)
    choices: list[Completion] | None = None  # n > 1: every sample returned
    vote: dict[str, int] | None = None  # n > 1 with `choices` labels: samples per label
    agreement: float | None = None  # n > 1 with `choices` labels: the majority label's share of samples
    # An embedding request: one unit vector per input, in input order; each a list of floats, or the base64
    # of its little-endian float32 values where the request asked for encoding_format "base64"
    embeddings: list[list[float]] | list[str] | None = None
    # What the request asked for that did not apply, one sentence each (e.g. reasoning fields on a model
    # without reasoning markers); None: nothing to say. A result-cache hit does not repeat them.
    warnings: list[str] | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    def to_user_json(self) -> bytes:
        """The JSONL output line (docs/architecture.md; no internal fields, no labeling fields not asked for)."""
        exclude = {"index", "worker"}
        if not self.attempt:
            exclude.add("attempt")
        if self.label_scores is None:
            exclude.add("label_scores")
        if self.logprobs is None:
            exclude.add("logprobs")
        if self.model is None:
            exclude.add("model")
        exclude.update(
            k
            for k in (
                "choices",
                "vote",
                "agreement",
                "embeddings",
                "reasoning_content",
                "warnings",
                "dtype",
                "batch_invariant",
            )
            if getattr(self, k) is None
        )
        out = self.model_dump(mode="json", exclude=exclude)
        for c in out.get("choices", ()):
            if c["logprobs"] is None:
                del c["logprobs"]
            if c["reasoning_content"] is None:
                del c["reasoning_content"]
        if self.usage.completion_tokens_details is None:  # no reasoning parser ran
            del out["usage"]["completion_tokens_details"]
        return orjson.dumps(out)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Result:
        return cls.model_validate(orjson.loads(raw))


class BatchStatus(_Strict):
    """A batch's counts, each request counted once, by its current attempt: queued + running + completed +
    failed + cancelled == total. A request `producer retry` re-enqueued is queued or running again (and
    counted in `retrying`) until its new attempt ends.

    `state` follows the counts (store.batch_state): queued while no request has started or finished,
    running while any request has no result, then cancelled if any request's result is `cancelled`, else
    completed (failed requests included: they are counted in `failed`, as OpenAI's completed batches count
    theirs). A retry that takes cancelled results back thus changes the state with them.

    `enqueued`: None once the submit put every request into Redis; while a submit is unfinished (still
    running, or interrupted: Redis refused a write, the process died), how many requests it has put there
    so far (as jobs, or as results: invalid lines, result-cache answers). The rest are counted in `queued`
    but are in no queue until the same submit (same file and options, same --batch-id) is run again."""

    batch_id: str
    state: BatchState
    total: int
    queued: int
    running: int
    completed: int
    failed: int
    cancelled: int
    # Of completed, by finish reason (failed: `error`; cancelled: `cancelled`). A batch written by workers
    # older than the eos / stop / repetition counters has fewer in those than it completed (finish_reasons).
    eos: int = 0
    stop: int = 0
    timed_out: int = 0  # of completed: ended on their timeout_s, with partial text (finish reason `timeout`)
    length: int = 0  # of completed: cut at max_new_tokens
    repetition: int = 0  # of completed: stopped by the repetition-loop detector
    prompt_tokens: int
    completion_tokens: int
    tokens_generated: int = 0  # generated by workers so far, running requests included: the rate counter
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from workers' prefix caches
    reasoning_tokens: int = 0  # of completion_tokens, a reasoning model's thinking
    from_result_cache: int = 0  # results answered from the result cache
    retrying: int = 0  # requests re-enqueued by `producer retry` whose new attempt has no result yet
    created_at: float
    finished_at: float | None = None
    queue: str | None = None
    model: str | None = None
    enqueued: int | None = None  # see the class docstring: None once the submit finished

    @property
    def done(self) -> int:
        """Requests with a final result (of their current attempt)."""
        return self.completed + self.failed + self.cancelled

    @property
    def partly_enqueued(self) -> bool:
        """The submit has not (yet) put every request into Redis."""
        return self.enqueued is not None and self.enqueued < self.total

    def finish_reasons(self) -> dict[str, int]:
        """How many results ended on each finish reason, those that occurred, in FinishReason's order. Where
        workers that did not count eos / stop / repetition wrote some results, those are together under
        "eos/stop/repetition"."""
        counted = {"eos": self.eos, "stop": self.stop, "length": self.length, "timeout": self.timed_out,
                   "repetition": self.repetition}  # fmt: skip
        uncounted = self.completed - sum(counted.values())
        reasons = {**counted, "cancelled": self.cancelled, "error": self.failed}
        if uncounted > 0:
            reasons["eos/stop/repetition"] = uncounted
        return {k: n for k, n in reasons.items() if n > 0}


# ---- Input lines (docs/architecture.md, "Input"): what a user may write on one JSONL line. ----

MAX_ID_CHARS = 512
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
UserId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class PromptLine(SamplingParams):
    """Shapes 1 and 2: `{"id", "prompt" | "messages", <params>, "metadata"}`; params sit at the top level."""

    id: UserId | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    metadata: dict[str, Any] | None = None


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


class OpenAIBatchLine(_Strict):
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


EMBEDDINGS_URL = "/v1/embeddings"


class EmbeddingFields(_Strict):
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


class OpenAIEmbeddingBody(EmbeddingFields):
    """The `body` of an OpenAI Batch line to /v1/embeddings; `user` is accepted and ignored."""

    model: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None


class OpenAIEmbeddingLine(_Strict):
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


# structured_outputs is folded into the constraint fields on validation.
_RESOLVED_FIELDS = tuple(k for k in SamplingParams.model_fields if k != "structured_outputs")
_CONSTRAINTS = ("choices", "response_format", "regex")
