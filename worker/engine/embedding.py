"""An embedding request inside the engine: one sequence per input, one result when all are pooled. Pure Python.

Each input is a prefill-only sequence: it is admitted, chunked and prefix-cached like a prompt, and ends
(its blocks freed) in the step that computes its last token; the request ends when its last input does,
or, at once for all its inputs, on a timeout, a cancellation or an engine error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.request import EngineError, EngineRequest, EngineResult, FinishReason
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence


def input_id(request_id: str, index: int) -> str:
    """The engine's id of an embedding request's input (the scheduler and block manager key on it)."""
    return f"{request_id}#embed{index}"


@dataclass
class EmbeddingGroup:
    request: EngineRequest
    seqs: list[Sequence]
    started_at: float  # monotonic
    vectors: dict[int, list[float]] = field(default_factory=dict)  # input index -> its unit vector

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, seq: Sequence, vector: list[float]) -> bool:
        """Record an input's vector; True once every input has one."""
        self.vectors[seq.embedding_index] = vector
        return len(self.vectors) == len(self.seqs)

    def result(self, now: float, reason: FinishReason, error: EngineError | None = None) -> EngineResult:
        """The request's result: every vector in input order when all were pooled ("stop"), else none."""
        complete = reason == "stop" and len(self.vectors) == len(self.seqs)
        return EngineResult(
            request_id=self.request_id,
            text="",
            token_ids=[],
            finish_reason=reason,
            prompt_tokens=sum(s.prompt_len for s in self.seqs),
            completion_tokens=0,
            cached_tokens=sum(s.cached_prompt_tokens for s in self.seqs),
            ttft_s=None,
            total_s=now - self.started_at,
            error=error,
            label_scores=None,
            logprobs=None,
            embeddings=[self.vectors[i] for i in range(len(self.seqs))] if complete else None,
        )


class EmbeddingRequests:
    """The engine's embedding requests in flight. Shares the engine's sequences by id (`seqs`), where
    each input is too, and ends inputs through the scheduler, which frees their blocks."""

    def __init__(self, scheduler: Scheduler, seqs: dict[str, Sequence]) -> None:
        self.scheduler = scheduler
        self.seqs = seqs
        self.groups: dict[str, EmbeddingGroup] = {}

    def add(self, req: EngineRequest, inputs: list[Sequence]) -> None:
        self.groups[req.request_id] = EmbeddingGroup(req, inputs, inputs[0].started_at)

    def pooled(self, seq: Sequence, vector: list[float], now: float) -> EngineResult | None:
        """An input's vector is pooled: it ends, its blocks go back; -> its request's result once it was
        the last input."""
        assert seq.embedding_of is not None
        group = self.groups[seq.embedding_of]
        self._end_input(seq, "stop")
        if not group.put(seq, vector):
            return None
        del self.groups[group.request_id]
        return group.result(now, "stop")

    def end(
        self, request_id: str, reason: FinishReason, now: float, error: EngineError | None = None
    ) -> EngineResult:
        """End a request before all its vectors are pooled (timeout, cancel, error), every input it still
        has in the engine with it."""
        group = self.groups.pop(request_id)
        for seq in group.seqs:
            if seq.status != "finished":
                self._end_input(seq, reason)
        return group.result(now, reason, error)

    def _end_input(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        del self.seqs[seq.request_id]
