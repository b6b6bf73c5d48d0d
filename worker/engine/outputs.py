"""What a finished request reports beyond its text: label scores of a `choices` request, token logprobs.

Pure Python over numbers the model runner computed; the token texts come from the grammar library's
view of the vocabulary (exact bytes for every token, byte-level and SentencePiece alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from worker.engine.request import (
    EngineError,
    EngineResult,
    FinishReason,
    LabelScore,
    TokenChoice,
    TokenLogprob,
)
from worker.engine.sampler import splitmix64_uniform
from worker.engine.sequence import RowLogprobs, Sequence


def label_scores(choices: tuple[str, ...], logprobs: list[float]) -> list[LabelScore]:
    """prob = softmax of the labels' logprobs (computed stably in float64)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [LabelScore(c, lp, w / total) for c, lp, w in zip(choices, logprobs, weights, strict=True)]


def pick_label(scores: list[LabelScore], temperature: float, seed: int) -> int:
    """Temperature 0: the label of highest logprob (the first on a tie). Otherwise a draw from the probs
    sharpened by 1 / temperature, with the request's seed (the same seed, the same label)."""
    if temperature == 0.0:
        return max(range(len(scores)), key=lambda i: (scores[i].logprob, -i))
    top = max(s.logprob for s in scores)
    weights = [math.exp((s.logprob - top) / temperature) for s in scores]
    u = splitmix64_uniform(seed, 0) * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if u < acc:
            return i
    return len(scores) - 1


class TokenTexts:
    """Token id -> (text, bytes), cached. `token_bytes` gives a token's exact bytes."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            raw = self._bytes(token)
            hit = self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def entries(self, rows: list[RowLogprobs]) -> list[TokenLogprob]:
        out = []
        for r in rows:
            text, raw = self(r.token)
            top = [TokenChoice(*self(t), lp) for t, lp in zip(r.top_ids, r.top_logprobs, strict=True)]
            out.append(TokenLogprob(text, raw, r.logprob, top))
        return out


def sequence_result(
    token_texts: TokenTexts,
    seq: Sequence,
    reason: FinishReason,
    now: float,
    scores: list[LabelScore] | None = None,
    error: EngineError | None = None,
) -> EngineResult:
    """A sequence's result as it ends for `reason`: its text settled, its answer's logprobs with their texts."""
    seq.finish_reason = reason
    seq.settle_text()
    logprobs = None
    if seq.params.logprobs and error is None:
        rows = seq.token_logprobs
        last = seq.output_ids[-1] if seq.output_ids else None
        ended = reason == "eos" or (reason == "stop" and last in seq.params.stop_token_ids)
        if rows and ended and seq.labels is None and seq.in_answer:
            # A generated final EOS / stop token is counted, never shown; a label's EOS is shown, as
            # a term of the label's score.
            rows = rows[:-1]
        logprobs = token_texts.entries(rows)
    return seq.to_result(now, logprobs=logprobs, label_scores=scores, error=error)
