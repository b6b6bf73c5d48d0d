"""The result cache's keys and stored answers, shared by the producer (lookups at submit) and the workers.

A request's output is determined when it is greedy (temperature 0) or sampled with a seed the user gave;
anything else (an unset temperature samples at the engine's default of 1) is never cached. Its key is
sha256 of:
- the engine fingerprint of the workers that serve the queue (worker/engine/fingerprint.py: weights,
  dtype, numerics version, device, attention path, output-shaping settings, tokenizer and chat template);
- the request's prompt or messages, as the worker receives them (an image as its reference, which names
  its content: producer/wire/images.py; a request with an http(s) image URL is never cached);
- every resolved parameter that can change the output: greedy decoding ignores seed, top_p, top_k and
  min_p, and timeout_s never counts. n and best_of count where they change the answer (n > 1, best_of >
  n): an n=1 request keeps the key it always had, and a cached n > 1 answer holds all n samples.
The request text (with the tokenizer and chat template in the fingerprint) rather than its token ids:
the producer has no tokenizer, and with the key computable here a rerun batch is answered at submit
time, without enqueuing a job. Workers publish their fingerprint and model per queue
(producer/wire/workers.py QueueServing) and look up again when a job runs.

A cached answer only ever answers a request for the model that computed it: submit looks a request up
only when it names no model or names the model the queue's workers serve, and for a request that names
one, only while a live worker of the queue serves it; a worker refuses a request for another model
before it looks anything up.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict

from producer.wire import keys
from producer.wire.images import has_web_images
from producer.wire.results import ChoiceLogprobs, Completion, FinishReason, LabelScore, Result, Timing, Usage

_NEVER = frozenset({"timeout_s"})  # parameters that cannot change the output
_GREEDY_IGNORES = frozenset({"seed", "top_p", "top_k", "min_p"})  # greedy takes the argmax before them
CACHEABLE: frozenset[str] = frozenset({"eos", "stop", "length", "repetition"})  # ended on their own


def cacheable(result: Result) -> bool:
    """Whether a computed result is an answer to keep: it, and every sample of it, ended on its own."""
    return result.finish_reason in CACHEABLE and all(
        c.finish_reason in CACHEABLE for c in result.choices or ()
    )


def request_key(
    fingerprint: str, prompt: str | None, messages: list[dict[str, Any]] | None, params: dict[str, Any]
) -> str | None:
    """The cache key of a request with resolved wire `params` (None values = unset), or None when its
    output is not determined."""
    greedy = params.get("temperature") == 0
    if not greedy and params.get("seed") is None:
        return None
    if messages is not None and has_web_images(messages):
        return None
    drop = _NEVER | _GREEDY_IGNORES if greedy else _NEVER
    fields = {k: v for k, v in params.items() if v is not None and k not in drop}
    n = fields.get("n", 1)
    if n == 1:
        fields.pop("n", None)
    if fields.get("best_of") == n:  # best_of == n ranks nothing: the same n samples
        del fields["best_of"]
    msgs = None if messages is None else [{k: v for k, v in m.items() if v is not None} for m in messages]
    blob = orjson.dumps([fingerprint, prompt, msgs, fields], option=orjson.OPT_SORT_KEYS)
    return keys.result_cache(hashlib.sha256(blob).hexdigest())


class CachedAnswer(BaseModel):
    """What the cache keeps of a computed result: its answer and the usage of the run that computed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    label_scores: list[LabelScore] | None = None
    logprobs: ChoiceLogprobs | None = None
    model: str | None = None  # the model that computed it (None: stored before answers named it)
    dtype: str | None = None  # and its arithmetic (None: stored before answers named it)
    batch_invariant: bool | None = None
    choices: list[Completion] | None = None  # n > 1: every sample
    vote: dict[str, int] | None = None
    agreement: float | None = None
    reasoning_content: str | None = (
        None  # a reasoning model's thinking, and its tokens (of completion_tokens)
    )
    reasoning_tokens: int | None = None

    @classmethod
    def of(cls, result: Result) -> CachedAnswer:
        """What the cache keeps of a computed result."""
        u = result.usage
        return cls(
            text=result.text, finish_reason=result.finish_reason, prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens, cached_tokens=u.prompt_tokens_details.cached_tokens,
            label_scores=result.label_scores, logprobs=result.logprobs, model=result.model, dtype=result.dtype,
            batch_invariant=result.batch_invariant,
            choices=result.choices, vote=result.vote, agreement=result.agreement,
            reasoning_content=result.reasoning_content,
            reasoning_tokens=d.reasoning_tokens if (d := u.completion_tokens_details) is not None else None,
        )  # fmt: skip

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(exclude_none=True))

    @classmethod
    def from_json(cls, raw: bytes | str) -> CachedAnswer:
        return cls.model_validate(orjson.loads(raw))

    def result(
        self, rid: str, index: int, metadata: dict[str, Any] | None, *, timing: Timing, worker: str | None
    ) -> Result:
        """The stored answer as request `rid`'s result: cached, with the original usage."""
        return Result(
            id=rid,
            index=index,
            text=self.text,
            finish_reason=self.finish_reason,
            usage=Usage.counted(
                self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.reasoning_tokens
            ),
            reasoning_content=self.reasoning_content,
            timing=timing,
            metadata=metadata,
            worker=worker,
            cached=True,
            label_scores=self.label_scores,
            logprobs=self.logprobs,
            model=self.model,
            dtype=self.dtype,
            batch_invariant=self.batch_invariant,
            choices=self.choices,
            vote=self.vote,
            agreement=self.agreement,
        )
