"""What the console shows of a batch's results, computed in one pass over them: finish reasons, failed
requests, throughput over time, and for a `choices` batch its labels (distribution, confidence histogram,
the least-confident rows). Pure Python over contract Results: no Redis, no HTTP (producer/api/console_api.py
reads the results and serves these as JSON).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from producer.wire.results import Result

MAX_ERRORS = 200  # failed requests listed on the batch page (the error file has all of them)
CHART_BINS = 40
HIST_BINS = 10  # of the top label's probability: [0, 0.1), ..., [0.9, 1.0]
MIN_SHARED_CHARS = 20  # a shorter common start ("Review: ", "The ") is no shared instruction worth hiding


@dataclass(frozen=True)
class LabelRow:
    """A `choices` result as a person reviewing it sees it: its answer and its two most probable labels."""

    index: int
    id: str
    answer: str
    top: str
    top_prob: float
    second: str | None
    second_prob: float | None

    @classmethod
    def of(cls, result: Result) -> LabelRow | None:
        if not result.label_scores:
            return None
        ranked = sorted(result.label_scores, key=lambda s: -s.prob)
        second = ranked[1] if len(ranked) > 1 else None
        return cls(
            result.index, result.id, result.text, ranked[0].label, ranked[0].prob,
            second.label if second else None, second.prob if second else None,
        )  # fmt: skip

    def matches(self, label: str | None, max_prob: float | None) -> bool:
        return (label is None or self.answer == label) and (max_prob is None or self.top_prob <= max_prob)

    def to_dict(self, excerpt: str | None = None, shared: str | None = None) -> dict[str, Any]:
        """`excerpt`: the row's input as submit kept it; `shared`: the start every row shown shares
        (shared_start), so that `input_differs` is what sets this row apart: the input past that start
        ("" when the input is that start alone), the whole input when the rows share none."""
        out: dict[str, Any] = {
            "index": self.index,
            "id": self.id,
            "answer": self.answer,
            "labels": [{"label": self.top, "prob": self.top_prob}],
        }
        if self.second is not None:
            out["labels"].append({"label": self.second, "prob": self.second_prob})
        if excerpt is not None:
            out["input"] = excerpt
            if shared is not None:
                out["input_differs"] = excerpt[len(shared) :] if excerpt.startswith(shared) else excerpt
        return out


def shared_start(texts: list[str]) -> str:
    """The start every one of `texts` shares, up to the end of a word (a prompt's shared instruction), or ""
    when there are fewer than two texts or the start they share is under MIN_SHARED_CHARS."""
    if len(texts) < 2:
        return ""
    first, last = min(texts), max(texts)  # the common prefix of all is that of these two
    n = 0
    while n < len(first) and first[n] == last[n]:  # first <= last: first[n] == last[n] for n < len(first)
        n += 1
    if first != last and n and first[n - 1] != " ":  # it ends inside a word: back to that word's start
        n = first.rfind(" ", 0, n) + 1
    start = first[:n]
    return start if len(start.rstrip()) >= MIN_SHARED_CHARS else ""


def least_confident(rows: list[LabelRow], *, label: str | None, max_prob: float | None) -> list[LabelRow]:
    """The rows a filter keeps, least confident first (ties in input order)."""
    return sorted((r for r in rows if r.matches(label, max_prob)), key=lambda r: (r.top_prob, r.index))


@dataclass
class BatchReport:
    """Feed it a batch's results (add), then read its parts. `created_at`: the batch's, the origin of
    the throughput chart."""

    created_at: float
    reasons: Counter[str] = field(default_factory=Counter)
    errors: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0
    label_rows: list[LabelRow] = field(default_factory=list)
    finishes: list[tuple[float, int]] = field(default_factory=list)  # (seconds after creation, tokens)
    untimed: int = 0  # results the chart cannot place (answered from the result cache, or retried)
    model: str | None = None  # the model that answered (the first result that names one)

    def add(self, result: Result) -> None:
        self.reasons[result.finish_reason] += 1
        self.model = self.model or result.model
        if result.finish_reason == "error":
            self.failed += 1
            if len(self.errors) < MAX_ERRORS:
                err = result.error
                self.errors.append({
                    "index": result.index,
                    "id": result.id,
                    "type": err.type if err else "error",
                    "message": err.message if err else "",
                })  # fmt: skip
        row = LabelRow.of(result)
        if row is not None:
            self.label_rows.append(row)
        t = result.timing
        # A first attempt was enqueued when its batch was created; a retry's enqueue time is not kept.
        if result.attempt == 0 and not result.cached and t.total_s is not None and t.queued_s is not None:
            self.finishes.append((t.queued_s + t.total_s, result.usage.completion_tokens))
        elif result.finish_reason not in ("cancelled", "error"):
            self.untimed += 1

    def throughput(self, bins: int = CHART_BINS) -> dict[str, Any]:
        """Completion tokens per second over the batch's life so far, in `bins` equal spans from its
        creation to its last finished request."""
        if not self.finishes:
            return {"bin_s": 0.0, "tok_s": [], "untimed": self.untimed}
        end = max(t for t, _ in self.finishes)
        bin_s = max(end / bins, 1e-3)
        tokens = [0] * bins
        for t, n in self.finishes:
            tokens[min(int(t / bin_s), bins - 1)] += n
        return {"bin_s": bin_s, "tok_s": [n / bin_s for n in tokens], "untimed": self.untimed}

    def labels(self) -> dict[str, Any] | None:
        """The distribution of answers and the histogram of the top label's probability (None: no row
        has label scores, not a `choices` batch)."""
        if not self.label_rows:
            return None
        hist = [0] * HIST_BINS
        for r in self.label_rows:
            hist[min(int(r.top_prob * HIST_BINS), HIST_BINS - 1)] += 1
        dist = Counter(r.answer for r in self.label_rows)
        return {
            "rows": len(self.label_rows),
            "distribution": [
                {"label": k, "count": n} for k, n in sorted(dist.items(), key=lambda kv: -kv[1])
            ],
            "histogram": hist,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "finish_reasons": dict(self.reasons.most_common()),
            "failed": self.failed,
            "errors": self.errors,
            "errors_shown": len(self.errors),
            "throughput": self.throughput(),
            "has_labels": bool(self.label_rows),
            "model": self.model,
        }
