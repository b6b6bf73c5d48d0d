"""xgrammar against llguidance on this machine: the two grammar libraries that could constrain decoding.

    python benchmarks/grammar_bench.py [--batch 64] [--steps 40]

With SmolLM2's tokenizer (vocab 49,152) and a nested JSON schema of 10 fields, it measures for each:
- compile time of the schema (a fresh compiler, no cache), and of a regex;
- the time to fill the token masks of a decode step for --batch sequences, each at a different point of
  a valid JSON document (advanced through the same grammar by a reference answer, token by token),
  filled one by one, and with the library's batch call where it has one;
and checks that both allow the reference answer's tokens and forbid a token that breaks the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string", "maxLength": 80},
        "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "verified": {"type": "boolean"}},
            "required": ["name", "verified"],
        },
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "language": {"type": "string", "enum": ["en", "de", "fr"]},
        "entities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "kind": {"enum": ["person", "org", "place"]}},
                "required": ["text", "kind"],
            },
        },
        "summary": {"type": ["string", "null"]},
    },
    "required": [
        "id",
        "title",
        "sentiment",
        "score",
        "tags",
        "author",
        "date",
        "language",
        "entities",
        "summary",
    ],
    "additionalProperties": False,
}
ANSWER = {
    "id": 7, "title": "Late but great", "sentiment": "mixed", "score": 0.5, "tags": ["delivery", "quality"],
    "author": {"name": "Ada", "verified": True}, "date": "2026-11-30", "language": "en",
    "entities": [{"text": "Acme", "kind": "org"}], "summary": None,
}  # fmt: skip
REGEX = r"(yes|no|maybe)\. Confidence: (0\.[0-9]{1,3}|1\.0)"


def timed(fn: Any, reps: int = 1) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run_xgrammar(tok: Any, vocab: int, answer_ids: list[int], batch: int, steps: int) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    schema = json.dumps(SCHEMA)
    compile_s, compiled = timed(
        lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema), 3
    )
    regex_s, _ = timed(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(REGEX), 3)
    matchers = []
    for i in range(batch):  # each at another point of the answer
        m = xgr.GrammarMatcher(compiled)
        for t in answer_ids[: (i * 7) % (len(answer_ids) - steps)]:
            assert m.accept_token(t)
        matchers.append(m)
    bitmask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    one, many = [], []
    batcher = xgr.BatchGrammarMatcher()
    for _ in range(steps):
        one.append(timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)])[0])
        many.append(timed(lambda: batcher.batch_fill_next_token_bitmask(matchers, bitmask))[0])
    logits = torch.zeros(batch, vocab)
    apply_s, _ = timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), 5)
    check = xgr.GrammarMatcher(compiled)
    ok = all(check.accept_token(t) for t in answer_ids)
    bad = tok.encode("}", add_special_tokens=False)[0]
    forbids = not xgr.GrammarMatcher(compiled).accept_token(bad)
    return {"library": f"xgrammar {xgr.__version__ if hasattr(xgr, '__version__') else ''}".strip(),
            "compile_schema_ms": compile_s * 1e3, "compile_regex_ms": regex_s * 1e3,
            "mask_ms_one_by_one": statistics.median(one) * 1e3, "mask_ms_batched": statistics.median(many) * 1e3,
            "apply_ms": apply_s * 1e3, "accepts_answer": ok, "forbids_bad_token": forbids}  # fmt: skip


def run_llguidance(tok: Any, vocab: int, answer_ids: list[int], batch: int, steps: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    schema = json.dumps(SCHEMA)

    def compile_schema() -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        return llguidance.LLMatcher(lltok, grammar)  # compiles lazily per matcher: the first one pays

    compile_s, _ = timed(compile_schema, 3)
    regex_s, _ = timed(lambda: llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_regex(REGEX)), 3)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matchers = []
    for i in range(batch):
        m = llguidance.LLMatcher(lltok, grammar)
        for t in answer_ids[: (i * 7) % (len(answer_ids) - steps)]:
            assert m.consume_token(t), m.get_error()
        matchers.append(m)
    bitmask = llt.allocate_token_bitmask(batch, lltok.vocab_size)
    executor = llguidance.LLExecutor()
    one, many = [], []
    for _ in range(steps):
        one.append(
            timed(lambda: [llt.fill_next_token_bitmask(m, bitmask, i) for i, m in enumerate(matchers)])[0]
        )
        many.append(timed(lambda: llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask))[0])  # fmt: skip
    logits = torch.zeros(batch, vocab)
    apply_s, _ = timed(lambda: llt.apply_token_bitmask_inplace(logits, bitmask), 5)
    check = llguidance.LLMatcher(lltok, grammar)
    ok = all(check.consume_token(t) for t in answer_ids)
    bad = tok.encode("}", add_special_tokens=False)[0]
    forbids = not llguidance.LLMatcher(lltok, grammar).consume_token(bad)
    return {"library": f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}".strip(),
            "compile_schema_ms": compile_s * 1e3, "compile_regex_ms": regex_s * 1e3,
            "mask_ms_one_by_one": statistics.median(one) * 1e3, "mask_ms_batched": statistics.median(many) * 1e3,
            "apply_ms": apply_s * 1e3, "accepts_answer": ok, "forbids_bad_token": forbids}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    ns = p.parse_args()
    from transformers import AutoTokenizer

    from worker.models.resolve import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))
    vocab = 49152
    answer_ids = tok.encode(json.dumps(ANSWER), add_special_tokens=False)
    rows = [run_llguidance(tok, vocab, answer_ids, ns.batch, ns.steps)]
    try:  # not a dependency: install it to compare (pip install xgrammar)
        rows.insert(0, run_xgrammar(tok, vocab, answer_ids, ns.batch, ns.steps))
    except ImportError:
        print("xgrammar is not installed (pip install xgrammar): measuring llguidance alone", file=sys.stderr)
    print(
        f"SmolLM2 tokenizer (vocab {vocab}), a 10-field nested JSON schema, {ns.batch} sequences per decode step"
    )
    print()
    print(
        "| library | compile schema ms | compile regex ms | masks one by one ms | masks batched ms | apply ms | sound |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['library']} | {r['compile_schema_ms']:.1f} | {r['compile_regex_ms']:.1f} | "
              f"{r['mask_ms_one_by_one']:.2f} | {r['mask_ms_batched']:.2f} | {r['apply_ms']:.2f} | "
              f"{r['accepts_answer'] and r['forbids_bad_token']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
