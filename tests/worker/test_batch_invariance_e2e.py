"""The held-out check of batch invariance, through real worker processes on the real model: the same
`choices` line and the same greedy line, answered by two fresh workers inside two differently composed
batches, give bitwise-equal label logprobs and token logprobs, and equal texts. Under the worker's default
dtype, and under the other one (a CPU's default is bfloat16 where linear.c multiplies in bfloat16, float32
elsewhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.worker.conftest import assert_consistent, results_count, submit, wait_until, write_jsonl
from worker.platform.cpu import cpu_dtype

pytestmark = pytest.mark.slow

INSTRUCTION = (
    "You label customer reviews for an online shop. Read the review, think about the customer's overall "
    "feeling toward the product and the service, and answer with one word. Ignore spelling mistakes and "
    "focus on what the customer would tell a friend about the purchase."
)


def review(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}]


# The two lines under test: in both batches, byte for byte.
LABEL = {
    "id": "label",
    "messages": review("The zipper broke on day one."),
    "choices": ["positive", "negative"],
}
GREEDY = {
    "id": "greedy",
    "messages": [{"role": "user", "content": "Write one sentence about a lighthouse keeper's evening."}],
    "max_new_tokens": 24,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 2,
}

# Batch A, on a worker that runs one request at a time: the labeling lines share the instruction, so the
# label line's prompt is mostly a prefix-cache hit and its step computes a few rows alone; the greedy line
# decodes alone (one row a step).
BATCH_A = [
    {"id": "a-review-1", "messages": review("Arrived early and fits perfectly."), "choices": ["positive", "negative"]},
    {"id": "a-review-2", "messages": review("Support never answered my emails."), "choices": ["positive", "negative"]},
    LABEL,
    GREEDY,
    {"id": "a-long", "prompt": "The log of the lighthouse, kept every evening: " * 40, "max_new_tokens": 8,
     "temperature": 0},
]  # fmt: skip
WORKER_A = ["--max-num-seqs", "1", "--prefetch", "1"]

# Batch B, on a worker that takes it all at once: the label line's whole prompt in one step of a few
# hundred rows, and the greedy line decoding beside 64 sampled sequences (steps of more rows than any size
# at which a kernel choice could change), an embeddings line, reasoning fields, a short prompt.
BATCH_B = [
    {"id": "b-samples", "prompt": "Name three colours:", "max_new_tokens": 40, "temperature": 0.8, "seed": 3,
     "n": 64},
    GREEDY,
    {"id": "b-embed", "input": [INSTRUCTION, "a short text"]},
    {"id": "b-reasoning", "messages": review("Worst purchase this year."), "choices": ["positive", "negative"],
     "max_reasoning_tokens": 16},
    LABEL,
    {"id": "b-short", "prompt": "Hi", "max_new_tokens": 3, "temperature": 0},
]  # fmt: skip
WORKER_B = ["--max-num-seqs", "96", "--prefetch", "16"]


def answer(server: Any, workers: Any, tmp_path: Path, lines: list[dict[str, Any]], name: str,
           *args: str) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The lines answered by a fresh worker of their own (stopped afterwards), computed afresh."""
    w = workers(server.url, "smollm2-135m", *args, name=name)
    # Submitted before the worker is up, so that it finds the whole batch waiting.
    bid = submit(server.url, write_jsonl(tmp_path / f"{name}.jsonl", lines), "--no-result-cache")
    w.wait_ready(300)
    wait_until(lambda: results_count(server.url, bid) == len(lines), 300, f"batch {name}'s results")
    w.stop()
    stored = assert_consistent(server.url, bid, len(lines))
    got = {r["id"]: r for r in stored.values()}
    assert all(r["error"] is None for r in got.values()), [r["error"] for r in got.values()]
    assert not any(r["cached"] for r in got.values())
    return got


@pytest.mark.parametrize("dtype", ["default", "other"])
def test_a_line_answers_the_same_in_two_differently_composed_batches(server, workers, tmp_path, dtype):
    default = str(cpu_dtype("auto", "auto", invariant=True)).removeprefix("torch.")
    want = default if dtype == "default" else "float32" if default == "bfloat16" else "bfloat16"
    args = [] if dtype == "default" else ["--dtype", want]
    a = answer(server, workers, tmp_path, BATCH_A, "a", *WORKER_A, *args)
    b = answer(server, workers, tmp_path, BATCH_B, "b", *WORKER_B, *args)
    for r in (*a.values(), *b.values()):  # each result names the arithmetic that answered it
        assert (r["dtype"], r["batch_invariant"]) == (want, True), r["id"]

    label_a, label_b = a["label"]["label_scores"], b["label"]["label_scores"]
    assert [s["label"] for s in label_a] == ["positive", "negative"]
    assert label_a == label_b, "label scores must be bitwise equal whatever shares the batch"
    assert a["label"]["text"] == b["label"]["text"]

    greedy_a, greedy_b = a["greedy"], b["greedy"]
    assert greedy_a["usage"]["completion_tokens"] > 0
    assert greedy_a["text"] == greedy_b["text"]
    assert greedy_a["logprobs"] == greedy_b["logprobs"], "token logprobs must be bitwise equal"
    # Floats came through JSON: equal values there are equal float32 bits (orjson writes the shortest
    # repr that round-trips a float64, and each was a float32 widened exactly).
