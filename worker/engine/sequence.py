"""One request's life inside the engine: its tokens, its text, its timings. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from worker.engine.block_manager import BlockHash
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.params import GenerationParams
from worker.engine.reasoning import ReasoningState
from worker.engine.request import EngineError, EngineResult, FinishReason, LabelScore, TokenLogprob
from worker.engine_config import Pooling

SequenceStatus = Literal["waiting", "running", "finished", "pending"]  # pending: a sample not yet forked


@dataclass(slots=True)
class Sequence:
    request_id: str
    params: GenerationParams
    prompt_ids: list[int]
    max_new_tokens: int  # params.max_new_tokens capped at max_model_len - prompt length
    started_at: float  # monotonic; timeout_s counts from here
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    # (These fields, read for every decoding sequence each step, lie together: slots in declaration order.)
    # The engine's fast path for decoded tokens (StopRules.prepare sets these at admission): a plain request
    # (no grammar, reasoning, labels, logprobs or penalties) appends a token without the full stop rules unless the
    # token is one of `ends_on` (every EOS, its stop ids), reaches max_new_tokens, or comes after
    # `deadline` (its timeout, a little early). With `defer_text` (a byte-level detokenizer) its text waits
    # until something needs it (settle_text): an id that may end a stop string (stop_bytes), the full
    # rules, its result.
    fast: bool = False
    defer_text: bool = False
    ends_on: frozenset[int] = frozenset()
    silent_ids: frozenset[int] = (
        frozenset()
    )  # ids counted but never rendered: its stop ids, EOS unless ignored
    deadline: float = math.inf
    stop_ends: frozenset[str] = frozenset()  # the last character of each stop string
    # a deferred text with stop strings: which ids may complete one (detokenizer.ending_bytes_table), and
    # whether the detokenizer held text back when it last caught up (the next ids catch up too)
    stop_bytes: bytes | None = None
    text_held: bool = False
    kv_room: int = (
        -1
    )  # generated tokens its block table covered when the scheduler last grew it (-1: unknown)
    sampling: tuple[Any, ...] | None = None  # its params' sampling settings (ModelRunner.sampling_row)
    # Engine's overlap (async scheduling): tokens sampled in steps launched but not yet taken, and its row in
    # the step launched last (the next step's input token is that step's token at this row)
    inflight: int = 0
    inflight_row: int = -1
    status: SequenceStatus = "waiting"
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # tokens of prefill_ids whose K/V came from the prefix cache at admission
    num_computed: int = 0  # tokens of prefill_ids in the cache so far (a long prompt fills over steps)
    prefilled: bool = False  # its prefill is complete: it decodes (or, with labels, is scored)
    cached_prompt_tokens: int = 0  # of the prompt, at its first admission (what usage reports)
    prompt_hashes: list[BlockHash] | None = None  # chain hashes of the prompt's full blocks (scheduler)
    matcher: Any = None  # grammar.GrammarState when the output is constrained
    token_logprobs: list[RowLogprobs] = field(default_factory=list)  # when params.logprobs (with labels:
    # the chosen label's, set when it is scored)
    # A `choices` request: each label's tokens (tokenised alone). It is prefilled, then scored in one
    # "score" step over scratch_blocks of its own (block_manager reserves them at admission).
    labels: list[list[int]] | None = None
    scratch_blocks: int = 0
    preemptions: int = 0  # times its blocks were taken back (it resumes by recomputing prompt + output)
    # A reasoning model's chat request: where its tokens stand (thinking or answer), its thinking's ids and
    # text. A `choices` request thinks first: its labels wait in
    # pending_labels until the answer starts, then it is scored after everything generated so far.
    reasoning: ReasoningState | None = None
    reasoning_ids: list[int] = field(default_factory=list)
    reasoning_text: str = ""
    reasoning_detokenizer: IncrementalDetokenizer | None = None
    pending_labels: list[list[int]] | None = None
    # n > 1 (worker/engine/samples.py): sample `sample_index` of request `group`; the leader (sample 0)
    # holds the samples still to fork from it once its prompt is computed
    group: str | None = None
    sample_index: int = 0
    forks: list[Sequence] = field(default_factory=list)
    ranked: bool = False  # best_of > n: its cumulative logprob ranks it among the request's samples
    cumulative_logprob: float = 0.0  # of its generated tokens, when ranked
    # An input of an embedding request (`embedding_of` its request id, `embedding_index` its place there):
    # prefilled, never decoded; its hidden states after the final norm, pooled, are its vector.
    pooling: Pooling | None = None
    embedding_of: str | None = None
    embedding_index: int = 0
    dimensions: int | None = None  # keep the first d of the pooled vector (Matryoshka)
    pooled: Any = None  # mean pooling: the runner's running sum of the hidden states computed so far
    # A LoRA adapter's request: its name, its content digest (the root of its prompt's block hashes: no KV
    # is shared across adapters) and, while it holds one, the adapter's slot (Scheduler admission; -1: none)
    lora: str | None = None
    lora_digest: str = ""
    lora_slot: int = -1
    # An image request (engine/images.py): its images' embeddings, M-RoPE positions and placeholders' rows;
    # and its prompt as the prefix cache hashes it (an image's tokens named by the image's content, not by
    # the one placeholder id every image's tokens share)
    vision: Any = None
    hash_ids: list[int] | None = None

    def settle_text(self) -> None:
        """Bring `text` up to its generated ids where it waits (defer_text): the detokenizer takes the ids it
        has not seen, but a final silent one (a stop id or EOS that ended the sequence is never rendered)."""
        if self.defer_text:
            ids = self.output_ids
            if ids and ids[-1] in self.silent_ids:
                ids = ids[:-1]
            self.text += self.detokenizer.catch_up(ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill computes: the prompt, and after a preemption the tokens generated so far too."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def hashed_prompt(self) -> list[int]:
        """The prompt as the prefix cache hashes it (hash_ids where images are in it)."""
        return self.prompt_ids if self.hash_ids is None else self.hash_ids

    @property
    def hashed_prefill(self) -> list[int]:
        """prefill_ids as the prefix cache hashes them."""
        return self.hashed_prompt + self.output_ids if self.output_ids else self.hashed_prompt

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def answer_ids(self) -> list[int]:
        """The generated tokens of the answer (all of them but for a reasoning model's thinking)."""
        # every token before the answer counts as a reasoning token, so the answer starts at that count
        return self.output_ids if self.reasoning is None else self.output_ids[self.reasoning.tokens :]

    @property
    def in_answer(self) -> bool:
        """Its next token belongs to the answer: the request's grammar, stop strings and labels apply."""
        return self.reasoning is None or self.reasoning.in_answer

    @property
    def constrained(self) -> bool:
        """Its next token is masked by its grammar: in the answer, and before a reasoning model's thinking
        opened (its opening token is then allowed too: model_runner); never inside the thinking."""
        if self.matcher is None:
            return False
        return self.in_answer or (self.reasoning is not None and self.reasoning.opening_token is not None)

    @property
    def scores_labels(self) -> bool:
        """A `choices` request (scored now, or once its thinking ends)."""
        return self.labels is not None or self.pending_labels is not None

    @property
    def max_total_tokens(self) -> int:
        """Worst-case tokens this sequence can ever hold: what admission reserves blocks for."""
        return self.prompt_len + self.max_new_tokens

    def to_result(
        self,
        now: float,
        logprobs: list[TokenLogprob] | None = None,
        label_scores: list[LabelScore] | None = None,
        error: EngineError | None = None,
    ) -> EngineResult:
        """Its result, finish_reason set. An error (the engine failed the step it was in) carries no text,
        tokens or time to first token: only what the sequence used (prompt, cache, tokens computed)."""
        assert self.finish_reason is not None and (error is None) == (self.finish_reason != "error")
        failed = error is not None
        ttft = None if self.first_token_at is None or failed else self.first_token_at - self.started_at
        return EngineResult(
            request_id=self.request_id,
            text="" if failed else self.text,
            token_ids=[] if failed else list(self.output_ids),
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_prompt_tokens,
            ttft_s=ttft,
            total_s=now - self.started_at,
            error=error,
            label_scores=label_scores,
            logprobs=logprobs,
            reasoning_content=None if self.reasoning is None or failed else self.reasoning_text,
            reasoning_tokens=0 if self.reasoning is None or failed else self.reasoning.tokens,
        )


@dataclass
class RowLogprobs:
    """One sampled (or, for a `choices` label, teacher-forced) token's log-probability under the raw model
    distribution, and the top alternatives."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
