"""The standard benchmark workload: a seeded generator shaped like users' batch jobs.

About 70% labeling requests (chat template, short answers, max_new_tokens 8-16) and 30% generation
requests (max_new_tokens 64-256); prompt lengths from 30 to 600 tokens; temperature 0.
Lines are in the producer's JSONL input format, so every contender gets the very same requests.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import orjson

WORDS = [
    "the",
    "customer",
    "said",
    "that",
    "delivery",
    "was",
    "late",
    "but",
    "the",
    "product",
    "quality",
    "was",
    "excellent",
    "and",
    "support",
    "answered",
    "quickly",
    "after",
    "a",
    "second",
    "email",
    "about",
    "the",
    "refund",
    "policy",
    "for",
    "damaged",
    "items",
    "in",
    "transit",
    "our",
    "team",
    "reviewed",
    "quarterly",
    "revenue",
    "growth",
    "across",
    "regions",
    "with",
    "strong",
    "demand",
    "in",
    "retail",
    "and",
    "weaker",
    "results",
    "in",
    "manufacturing",
    "while",
    "costs",
    "for",
    "energy",
    "and",
    "shipping",
    "rose",
    "sharply",
    "this",
    "year",
    "scientists",
    "observed",
    "a",
    "distant",
    "galaxy",
    "whose",
    "light",
    "left",
    "it",
    "billions",
    "of",
    "years",
    "ago",
    "revealing",
    "how",
    "early",
    "stars",
    "formed",
    "from",
    "clouds",
    "of",
    "hydrogen",
    "gas",
    "under",
    "gravity",
    "and",
    "magnetic",
    "fields",
    "over",
    "time",
    "the",
    "match",
    "ended",
    "in",
    "a",
    "draw",
    "after",
    "extra",
    "time",
    "when",
    "the",
    "goalkeeper",
    "saved",
    "a",
    "penalty",
    "in",
    "the",
    "final",
    "minute",
    "and",
    "fans",
    "celebrated",
    "in",
    "the",
    "streets",
    "of",
    "the",
    "old",
    "city",
    "until",
    "late",
    "into",
    "the",
    "night",
]

LABEL_TASKS = [
    ("Classify the sentiment of this review as positive, negative or neutral.", "Review"),
    ("Classify the topic of this text as business, sports, science or politics.", "Text"),
    ("Does this message contain a complaint? Answer yes or no.", "Message"),
    ("Extract the main entity mentioned in this text. Answer with one or two words.", "Text"),
]
GEN_TASKS = [
    "Write a detailed summary of the following text.",
    "Write a friendly reply to the following customer message.",
    "Continue the following story in the same style.",
    "Explain the following text to a ten-year-old.",
]


def _text(rng: random.Random, n_words: int) -> str:
    start = rng.randrange(len(WORDS))
    return " ".join(
        WORDS[(start + i) % len(WORDS)] if rng.random() > 0.1 else rng.choice(WORDS) for i in range(n_words)
    )


def generate(n: int = 256, seed: int = 0, tokenizer: Any | None = None) -> list[dict[str, Any]]:
    """n request lines. With a tokenizer, prompt bodies are sized so templated prompts span 30-600 tokens."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        labeling = rng.random() < 0.7
        target = (
            int(rng.uniform(30, 600)) if not labeling or rng.random() < 0.5 else int(rng.uniform(30, 250))
        )
        n_words = max(4, int(target * 0.75) - 30)
        body = _text(rng, n_words)
        if labeling:
            task, field = rng.choice(LABEL_TASKS)
            messages = [{"role": "system", "content": task}, {"role": "user", "content": f"{field}: {body}"}]
            max_new = rng.randint(8, 16)
        else:
            messages = [{"role": "user", "content": f"{rng.choice(GEN_TASKS)}\n\n{body}"}]
            max_new = rng.randint(64, 256)
        if tokenizer is not None:
            messages = _fit(tokenizer, messages, target)
        out.append(
            {
                "id": f"req-{i:05d}",
                "messages": messages,
                "max_new_tokens": max_new,
                "temperature": 0,
                "metadata": {"kind": "label" if labeling else "generate"},
            }
        )
    return out


def _fit(tokenizer: Any, messages: list[dict[str, str]], target: int) -> list[dict[str, str]]:
    """Trim or pad the last message's words until the templated prompt is about `target` tokens."""
    target = max(30, min(600, target))
    words = messages[-1]["content"].split(" ")
    for _ in range(8):
        msgs = [*messages[:-1], {"role": messages[-1]["role"], "content": " ".join(words)}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if abs(n - target) <= 3:
            return msgs
        if n > target:
            words = words[: max(1, len(words) - max(1, int((n - target) * 0.8)))]
        else:
            words = words + WORDS[: max(1, int((target - n) * 0.7))]
    return msgs


FEWSHOT_LABELS = ["positive", "negative", "neutral", "mixed"]


def fewshot(n: int = 1000, seed: int = 0, examples: int = 14) -> list[dict[str, Any]]:
    """A few-shot labeling batch: one instruction with `examples` worked examples (a system message of
    ~600 templated tokens, the same in every request), then a short item (20-80 tokens) to label with
    1-8 new tokens, greedy. The shape of an offline labeling job, where the prefix cache matters."""
    rng = random.Random(seed)
    shots = []
    for k in range(examples):
        shots.append(f"Review: {_text(rng, 32)}\nLabel: {FEWSHOT_LABELS[k % len(FEWSHOT_LABELS)]}")
    system = (
        "You label customer reviews by their overall sentiment. Answer with exactly one label: "
        + ", ".join(FEWSHOT_LABELS)
        + ". Mixed means clearly positive and clearly negative points together.\n\nExamples:\n\n"
        + "\n\n".join(shots)
    )
    out = []
    for i in range(n):
        item = _text(rng, rng.randint(14, 60))
        out.append(
            {
                "id": f"fs-{i:05d}",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Review: {item}"},
                ],
                "max_new_tokens": rng.randint(1, 8),
                "temperature": 0,
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description="Write the standard benchmark workload as JSONL.")
    p.add_argument("-n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    for line in generate(ns.n, ns.seed):
        sys.stdout.buffer.write(orjson.dumps(line) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
