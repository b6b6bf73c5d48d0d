"""The console's batch report over contract Results (producer/api/console_report.py), and the input
excerpts submit keeps for it: pure functions, no Redis."""

from __future__ import annotations

import pytest

from producer.api.console_report import BatchReport, LabelRow, least_confident, shared_start
from producer.client.submit import EXCERPT_CHARS, excerpt
from producer.wire.results import ErrorInfo, LabelScore, Result, Timing, Usage


def labeled(index: int, probs: dict[str, float], answer: str | None = None) -> Result:
    scores = [LabelScore(label=k, logprob=-1.0, prob=p) for k, p in probs.items()]
    text = answer or max(probs, key=lambda k: probs[k])
    return Result(id=f"r{index}", index=index, text=text, finish_reason="stop", label_scores=scores)


def test_label_rows_rank_the_two_most_probable_labels() -> None:
    row = LabelRow.of(labeled(3, {"a": 0.2, "b": 0.7, "c": 0.1}))
    assert row is not None
    assert (row.top, row.top_prob, row.second, row.second_prob, row.answer) == ("b", 0.7, "a", 0.2, "b")
    assert row.to_dict("the input")["labels"] == [{"label": "b", "prob": 0.7}, {"label": "a", "prob": 0.2}]
    assert LabelRow.of(Result(id="x", index=0, text="t", finish_reason="eos")) is None


def test_least_confident_first_filtered_by_answer_and_threshold() -> None:
    rows = [
        LabelRow.of(labeled(i, {"yes": p, "no": 1 - p}))
        for i, p in enumerate([0.9, 0.55, 0.3, 0.55, 0.99, 0.6])
    ]
    rows_ = [r for r in rows if r is not None]
    order = [r.index for r in least_confident(rows_, label=None, max_prob=None)]
    assert order == [1, 3, 5, 2, 0, 4]  # ties keep input order; index 2 answers "no" with 0.7
    assert [r.index for r in least_confident(rows_, label="yes", max_prob=0.6)] == [1, 3, 5]
    assert [r.index for r in least_confident(rows_, label="no", max_prob=None)] == [2]
    assert least_confident(rows_, label="maybe", max_prob=None) == []


def test_the_report_counts_reasons_errors_labels_and_throughput() -> None:
    report = BatchReport(created_at=100.0)
    report.add(labeled(0, {"x": 0.95, "y": 0.05}))
    report.add(labeled(1, {"x": 0.45, "y": 0.55}))
    report.add(labeled(2, {"x": 1.0, "y": 0.0}))
    err = ErrorInfo(type="prompt_too_long", message="prompt has 50 tokens; the model context is 16")
    report.add(Result(id="bad", index=3, finish_reason="error", error=err))
    for i, (queued, total, tokens) in enumerate([(0.5, 1.0, 10), (1.0, 3.0, 30), (2.0, 2.0, 20)]):
        usage = Usage(prompt_tokens=1, completion_tokens=tokens, total_tokens=1 + tokens)
        timing = Timing(queued_s=queued, total_s=total)
        report.add(
            Result(id=f"t{i}", index=4 + i, text="t", finish_reason="length", usage=usage, timing=timing)
        )
    report.add(Result(id="c", index=7, text="t", finish_reason="eos", cached=True, model="tiny"))
    s = report.summary()
    assert s["finish_reasons"] == {"length": 3, "stop": 3, "error": 1, "eos": 1}
    assert s["errors"] == [{"index": 3, "id": "bad", "type": "prompt_too_long", "message": err.message}]
    assert s["has_labels"] is True and s["model"] == "tiny"
    labels = report.labels()
    assert labels is not None
    assert labels["distribution"] == [{"label": "x", "count": 2}, {"label": "y", "count": 1}]
    assert labels["histogram"] == [0, 0, 0, 0, 0, 1, 0, 0, 0, 2]  # 0.55 -> bin 5; 0.95 and 1.0 -> bin 9
    tp = report.throughput(bins=4)  # finishes at 1.5 s, 4 s and 4 s: bins of 1 s
    assert tp["bin_s"] == pytest.approx(1.0)
    assert tp["tok_s"] == pytest.approx([0.0, 10.0, 0.0, 50.0])
    assert tp["untimed"] == 4  # the three label rows (no timing) and the cached answer


def test_no_labels_and_nothing_to_chart() -> None:
    report = BatchReport(created_at=0.0)
    assert report.labels() is None
    assert report.throughput() == {"bin_s": 0.0, "tok_s": [], "untimed": 0}


def test_excerpt_is_the_prompt_or_the_last_user_message_cut_short() -> None:
    assert excerpt({"prompt": "  a\n b  ", "messages": None}) == "a b"
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]  # fmt: skip
    assert excerpt({"prompt": None, "messages": msgs}) == "second"
    assert excerpt({"prompt": None, "messages": [{"role": "system", "content": "only"}]}) == "only"
    long = excerpt({"prompt": "x" * 1000})
    assert len(long) == EXCERPT_CHARS and "\u2026" in long
    # rows sharing a long instruction keep what differs: the item at the end
    a, b = (
        excerpt({"prompt": "Label the review. " * 40 + item}) for item in ("Great fit.", "Broke at once.")
    )
    assert len(a) == len(b) == EXCERPT_CHARS
    assert a.endswith("Label the review. Great fit.") and b.endswith("Broke at once.")


INSTRUCTION = "Classify the sentiment of this review as positive, negative or neutral. Review: "


def test_the_inputs_shared_start_is_cut_at_a_word_and_each_row_keeps_what_differs() -> None:
    inputs = [INSTRUCTION + "great phone", INSTRUCTION + "broke at once", INSTRUCTION + "great"]
    assert shared_start(inputs) == INSTRUCTION
    row = LabelRow.of(labeled(0, {"positive": 0.6, "negative": 0.4}))
    assert row is not None
    d = row.to_dict(inputs[1], INSTRUCTION)
    assert d["input"] == inputs[1] and d["input_differs"] == "broke at once"
    assert row.to_dict("other", "")["input_differs"] == "other"  # no shared start: the whole input
    assert row.to_dict(INSTRUCTION, INSTRUCTION)["input_differs"] == ""  # the shared start alone
    assert "input_differs" not in row.to_dict(inputs[1])  # the export's rows: the input as kept
    # A common start that ends inside a word is cut back to that word's start.
    assert shared_start([INSTRUCTION + "greatest", INSTRUCTION + "great deal"]) == INSTRUCTION
    assert shared_start([INSTRUCTION + "x", INSTRUCTION]) == INSTRUCTION
    # One row, rows sharing little ("Review: "), or nothing: no shared start.
    assert shared_start([inputs[0]]) == ""
    assert shared_start(["Review: good", "Review: bad"]) == ""
    assert shared_start([inputs[0], ""]) == ""
