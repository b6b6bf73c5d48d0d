"""What labeling outputs cost: `choices` against free generation, and a JSON schema or top_logprobs=5
against plain decoding. The engine directly, SmolLM2-135M, one process.

    python benchmarks/labeling_bench.py            # part of `make bench`

1. The labeling share of the standard workload (benchmarks/workload.py: chat-templated classification
   prompts of 30-250+ tokens): the same requests as free generation (8-16 new tokens, as the workload
   asks) and with `choices` (the task's labels, scored exactly). Requests per second.
2. Decode: 64 requests x 64 new tokens (EOS ignored) plain, under a JSON schema that lets them write
   that long, and with logprobs + top_logprobs=5. Decode tokens per second over the decode steps.
3. In float32: the labeling requests again with kv_cache_dtype = bfloat16 and fp8_e4m3, and with
   weight_dtype = bfloat16 and int8, and how far the label probabilities move from float32's.
Prints a table and writes benchmarks/results/labeling-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LABELS = {
    "Classify the sentiment of this review as positive, negative or neutral.": ("positive", "negative", "neutral"),
    "Classify the topic of this text as business, sports, science or politics.": (
        "business", "sports", "science", "politics",
    ),
    "Does this message contain a complaint? Answer yes or no.": ("yes", "no"),
}  # fmt: skip
LONG_SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "topics": {"type": "array", "items": {"type": "string"}}},
    "required": ["summary", "topics"],
    "additionalProperties": False,
}


def run(engine: Any, reqs: list[Any]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    return time.perf_counter() - t0, out


def drift_of(narrow: Any, warm: Any, reqs: list[Any], scored: list[Any]) -> dict[str, Any]:
    """The labeling requests on an engine with a narrower KV cache or narrower weights against float32's
    scores."""
    warm(narrow)
    narrow_s, narrow_scored = run(narrow, reqs)
    diffs, same_top = [], 0
    for a, b in zip(scored, narrow_scored, strict=True):
        pa, pb = [x.prob for x in a.label_scores], [x.prob for x in b.label_scores]
        diffs += [abs(x - y) for x, y in zip(pa, pb, strict=True)]
        same_top += pa.index(max(pa)) == pb.index(max(pb))
    return {"requests": len(scored), "max_abs_prob_diff": max(diffs), "mean_abs_prob_diff": sum(diffs) / len(diffs),
            "same_top_label": same_top, "wall_s": narrow_s}  # fmt: skip


def report(info: dict[str, Any]) -> None:
    rows, decode_rows, drift = info["labeling"], info["decode"], info["narrow_drift"]
    m = info["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, dtype {info['dtype']}")
    print()
    print("| labeling share of the standard workload | requests | wall s | req/s |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['requests']} | {r['wall_s']:.1f} | {r['requests'] / r['wall_s']:.2f} |")
    print()
    base = decode_rows[0]["decode_tokens_per_s"]
    print("| 64 x 64 tokens | decode tok/s | vs plain |")
    print("|---|---:|---:|")
    for r in decode_rows:
        print(f"| {r['name']} | {r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / base:.2f}x |")
    if drift:
        print()
    for what, d in drift.items():
        print(
            f"{what} (float32 compute) vs float32, {d['requests']} `choices` requests: "
            f"label probabilities differ by {d['mean_abs_prob_diff']:.1e} on average, "
            f"{d['max_abs_prob_diff']:.1e} at most; top label identical for {d['same_top_label']}/"
            f"{d['requests']}; {d['requests'] / d['wall_s']:.2f} req/s"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "-n", type=int, default=256, help="requests of the standard workload to take labeling ones from"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ns = p.parse_args()

    import workload as wl
    from bench import machine

    from worker.engine.engine import Engine
    from worker.engine.params import Constraint, GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    if ns.dtype == "auto":
        from worker.platform.cpu import cpu_auto_dtype

        ns.dtype = str(cpu_auto_dtype("auto")).removeprefix("torch.")

    def load(kv_cache_dtype: str = "auto", weight_dtype: str = "auto") -> Any:
        cfg = EngineConfig(
            model="smollm2-135m",
            device="cpu",
            dtype=ns.dtype,
            kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
            weight_dtype=weight_dtype,  # type: ignore[arg-type]
        )
        return Engine.load(cfg)

    engine = load()
    lines = [ln for ln in wl.generate(ns.n, 0, engine.tokenizer) if ln["messages"][0]["content"] in LABELS]

    def labeling(tag: str, choices: bool) -> list[Any]:
        out = []
        for i, ln in enumerate(lines):
            labels = LABELS[ln["messages"][0]["content"]] if choices else ()
            params = GenerationParams(max_new_tokens=ln["max_new_tokens"], temperature=0.0, choices=labels)
            out.append(EngineRequest(f"{tag}{i}", params, messages=ln["messages"]))
        return out

    def warm(e: Any) -> None:  # allocator and kernels, on prompts the runs do not share
        p = GenerationParams(max_new_tokens=4, temperature=0.0, choices=("yes", "no"))
        e.generate(
            [
                EngineRequest(f"warm{i}", p, messages=[{"role": "user", "content": f"Warm up {i}?"}])
                for i in range(4)
            ]
        )

    # Each labeling run starts from an empty prefix cache (a fresh engine), so one run does not find
    # the prompts the run before it computed.
    warm(engine)
    free_s, _ = run(engine, labeling("free", False))
    del engine
    engine = load()
    warm(engine)
    choice_s, scored = run(engine, labeling("choice", True))
    rows = [
        {"name": "labeling requests, free generation", "requests": len(lines), "wall_s": free_s},
        {"name": "labeling requests, choices (scored labels)", "requests": len(lines), "wall_s": choice_s},
    ]
    prompt = [{"role": "user", "content": "Describe the weather in a long paragraph."}]

    def decode(tag: str, **kw: Any) -> list[Any]:
        return [
            EngineRequest(
                f"{tag}{i}",
                GenerationParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, **kw),
                messages=[{**prompt[0], "content": f"{prompt[0]['content']} ({i})"}],
            )
            for i in range(64)
        ]

    decode_rows = []
    for name, kw in (
        ("decode, plain", {}),
        ("decode, JSON schema", {"constraint": Constraint("json_schema", json.dumps(LONG_SCHEMA))}),
        ("decode, logprobs + top_logprobs=5", {"logprobs": True, "top_logprobs": 5}),
    ):
        engine.generate(decode("w" + name, **kw)[:2])
        before = engine.stats()
        wall, res = run(engine, decode(name, **kw))
        after = engine.stats()
        tokens = sum(r.completion_tokens for r in res)
        decode_rows.append({"name": name, "tokens": tokens, "wall_s": wall,
                            "decode_tokens_per_s": tokens / max(after.decode_s - before.decode_s, 1e-9)})  # fmt: skip
    drift = {}
    if ns.dtype == "float32":  # narrower KV caches and weights: how far they move the label probabilities
        del engine
        for kvd in ("bfloat16", "fp8_e4m3"):
            drift[f"{kvd} KV cache"] = drift_of(load(kvd), warm, labeling("choice", True), scored)
        for wd in ("bfloat16", "int8"):
            drift[f"{wd} weights"] = drift_of(load(weight_dtype=wd), warm, labeling("choice", True), scored)
    info = {
        "machine": machine(),
        "dtype": ns.dtype,
        "labeling": rows,
        "decode": decode_rows,
        "narrow_drift": drift,
    }
    report(info)
    out = ROOT / "benchmarks" / "results" / f"labeling-{ns.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
