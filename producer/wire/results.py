"""What a request's answer and a batch's progress look like on the wire: Result (with its usage, timing,
error, label scores, logprobs and samples) and BatchStatus.

Pure pydantic + orjson: importing this module must never import torch.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import Field

from producer.wire.strict import StrictModel

FinishReason = Literal["eos", "stop", "length", "timeout", "repetition", "cancelled", "error"]
BatchState = Literal["queued", "running", "completed", "cancelled"]


class PromptTokensDetails(StrictModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the worker's prefix cache (not computed)


class CompletionTokensDetails(StrictModel):
    reasoning_tokens: int = (
        0  # of completion_tokens, a reasoning model's before its answer (markers included)
    )


class Usage(StrictModel):
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


class Timing(StrictModel):
    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class ErrorInfo(StrictModel):
    type: str
    message: str


class LabelScore(StrictModel):
    """A `choices` label's score: logprob = sum of the log-probabilities of its tokens (the label tokenised
    alone) teacher-forced after the prompt, plus the log-probability of the model's first EOS token right
    after them; prob = softmax of the logprobs over the request's labels."""

    label: str
    logprob: float
    prob: float


class TopLogprob(StrictModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(StrictModel):
    """OpenAI's chat logprobs entry for one generated token."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(StrictModel):
    content: list[TokenLogprob] | None = None


class Completion(StrictModel):
    """One of the samples of an n > 1 request (Result.choices), as OpenAI's `choices[i]`."""

    index: int = Field(ge=0)
    text: str
    finish_reason: FinishReason
    completion_tokens: int = 0
    logprobs: ChoiceLogprobs | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking in this sample


class Result(StrictModel):
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


class BatchStatus(StrictModel):
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

    @property
    def in_queue(self) -> int:
        """Of `queued`, the requests in a queue now: a partly enqueued submit's rest is in none yet."""
        if self.enqueued is None:
            return self.queued
        return max(0, self.enqueued - self.done - self.running)

    @property
    def pending(self) -> int:
        """Work a worker has to do now: the requests in a queue plus those running. What an autoscaler
        scales workers on (producer serve's /metrics, batchq_queue_pending)."""
        return self.in_queue + self.running

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
