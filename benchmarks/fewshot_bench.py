"""Few-shot labeling: the prefix cache and the result cache against HF `generate`, on one workload.

    python benchmarks/fewshot_bench.py                 # part of `make bench`
    python benchmarks/fewshot_bench.py -n 1000 --off-n 200 --hf-n 48

The workload (benchmarks/workload.py `fewshot`): n requests sharing a ~600-token instruction with worked
examples, each with its own 20-80-token item and 1-8 new tokens, greedy. Contenders, each in its own
process, same prompts, model and dtype:
- engine, prefix cache off (on the first --off-n requests: at ~1,000 prompt tok/s the whole batch would
  take ten minutes; throughput is a rate, so a prefix of the batch measures it);
- engine, prefix cache on (all n);
- the queue path: `producer submit` -> one worker -> results, all n; then the same file submitted again
  as a new batch (a nightly rerun), answered from the result cache;
- HF `generate` (left-padded static batches, the better of batch sizes 1 and 8) on the first --hf-n.
Prints a table and writes benchmarks/results/fewshot-<dtype>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODEL = "smollm2-135m"


def prompt_tokens(lines: list[dict[str, Any]]) -> int:
    from transformers import AutoTokenizer

    from worker.models.resolve import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint(MODEL))
    texts = [
        tok.apply_chat_template(ln["messages"], add_generation_prompt=True, tokenize=False) for ln in lines
    ]
    return sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])


def run_engine(
    lines: list[dict[str, Any]], dtype: str, prefix_cache: bool, invariant: bool = True
) -> dict[str, Any]:
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    cfg = EngineConfig(
        model=MODEL, device="cpu", dtype=dtype, prefix_cache=prefix_cache, batch_invariant=invariant
    )
    engine = Engine.load(cfg)
    warm = [
        {"messages": [{"role": "user", "content": f"warm up {i}"}], "max_new_tokens": 2} for i in range(4)
    ]

    def reqs(ls: list[dict[str, Any]], tag: str) -> list[EngineRequest]:
        return [
            EngineRequest(
                f"{tag}{i}",
                GenerationParams(max_new_tokens=ln["max_new_tokens"], temperature=0.0),
                messages=ln["messages"],
            )
            for i, ln in enumerate(ls)
        ]

    engine.generate(reqs(warm, "w"))
    before = engine.stats()
    t0 = time.perf_counter()
    results = engine.generate(reqs(lines, "r"))
    wall = time.perf_counter() - t0
    after = engine.stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_prompt_tokens - before.cached_prompt_tokens
    return {
        "name": f"engine, prefix cache {'on' if prefix_cache else 'off'}"
        + ("" if invariant else f", {dtype}, batch_invariant = false (cascade attention)"),
        "requests": len(lines),
        "wall_s": wall,
        "requests_per_s": len(lines) / wall,
        "prompt_tokens": prompt,
        "computed_prompt_tokens": prompt - cached,
        "prompt_tokens_per_s": prompt / wall,
        "prefill_s": after.prefill_s - before.prefill_s,
        "texts": {f"fs-{i:05d}": r.text for i, r in enumerate(results)},
    }


def run_queue(lines: list[dict[str, Any]], dtype: str, workload: Path) -> dict[str, Any]:
    from worker.embedded_redis import RedisServer

    with RedisServer() as server:
        env = {**os.environ, "REDIS_URL": server.url}
        with open(workload.with_suffix(".worker.log"), "w") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "--model", MODEL, "--device", "cpu", "--dtype", dtype,
                 "--queue", "fewshot", "--log-interval-s", "5"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip
            try:
                return asyncio.run(_queue_client(server.url, len(lines), workload, worker))
            finally:
                worker.terminate()
                worker.wait(60)


async def _queue_client(url: str, n: int, workload: Path, worker: Any) -> dict[str, Any]:
    from producer.client.batchq_client import BatchqClient

    async with BatchqClient.from_url(url) as client:
        deadline = time.monotonic() + 600
        while not await client.redis.keys("batchq:worker:*"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start")
            await asyncio.sleep(0.5)
        runs = []
        for _ in range(2):  # the batch, then the same file again as a new batch (a nightly rerun)
            t0 = time.perf_counter()
            report = await client.submit_file(str(workload), queue="fewshot")
            status = await client.wait(report.batch_id, timeout=7200, poll_s=0.1)
            wall = time.perf_counter() - t0
            texts = {r.id: r.text async for r in client.results(report.batch_id)}
            runs.append((wall, status, texts))
    (w1, s1, texts), (w2, s2, texts2) = runs
    return {
        "name": "queue: submit+worker+results",
        "requests": n,
        "wall_s": w1,
        "requests_per_s": n / w1,
        "prompt_tokens": s1.prompt_tokens,
        "computed_prompt_tokens": s1.prompt_tokens - s1.cached_prompt_tokens,
        "prompt_tokens_per_s": s1.prompt_tokens / w1,
        "rerun_wall_s": w2,
        "rerun_from_result_cache": s2.from_result_cache,
        "rerun_texts_equal": sum(texts2.get(k) == v for k, v in texts.items()),
        "texts": texts,
    }


def run_hf(lines: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models.resolve import hf_checkpoint

    ckpt = hf_checkpoint(MODEL)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    eos = model.generation_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    texts = [
        tok.apply_chat_template(ln["messages"], add_generation_prompt=True, tokenize=False) for ln in lines
    ]
    best: dict[str, Any] = {}
    for bs in (1, 8):
        outs: dict[str, str] = {}
        t0 = time.perf_counter()
        for s in range(0, len(lines), bs):
            chunk = list(range(s, min(s + bs, len(lines))))
            enc = tok([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=max(lines[i]["max_new_tokens"] for i in chunk),
                                     do_sample=False, pad_token_id=eos_ids[0])  # fmt: skip
            for row, i in enumerate(chunk):
                ids = gen[row, enc["input_ids"].shape[1] :].tolist()[: lines[i]["max_new_tokens"]]
                cut = next((k + 1 for k, t in enumerate(ids) if t in eos_ids), None)
                outs[lines[i]["id"]] = tok.decode(ids[:cut] if cut else ids, skip_special_tokens=True)
        wall = time.perf_counter() - t0
        print(f"    HF bs={bs}: {len(lines) / wall:.2f} req/s", file=sys.stderr, flush=True)
        if not best or wall < best["wall_s"]:
            best = {"name": f"HF generate (bs={bs})", "requests": len(lines), "wall_s": wall,
                    "requests_per_s": len(lines) / wall, "texts": outs}  # fmt: skip
    best["prompt_tokens"] = prompt_tokens(lines)
    best["computed_prompt_tokens"] = best["prompt_tokens"]
    best["prompt_tokens_per_s"] = best["prompt_tokens"] / best["wall_s"]
    return best


def contender(mode: str, workload: Path, n: int, dtype: str) -> dict[str, Any]:
    out = workload.with_name(f"{mode}.json")
    print(f"  running {mode} on {n} requests ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, __file__, "--contender", mode, "--workload", str(workload), "-n", str(n),
           "--dtype", dtype, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    return dict(orjson.loads(out.read_bytes()))


def table(info: dict[str, Any], rows: list[dict[str, Any]], hf_rps: float) -> str:
    m = info["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, dtype {info['dtype']}",
        f"workload: few-shot labeling, shared prefix ~{info['shared_prefix_tokens']} tokens, greedy",
        "",
        "| contender | requests | wall s | req/s | prompt tok/s | prompt tokens computed | vs HF req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['requests']} | {r['wall_s']:.1f} | {r['requests_per_s']:.2f} | "
            f"{r['prompt_tokens_per_s']:.0f} | {r['computed_prompt_tokens']} | {r['requests_per_s'] / hf_rps:.1f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=1000, help="requests (prefix cache on, queue path)")
    p.add_argument("--off-n", type=int, default=200, help="requests for the prefix-cache-off engine")
    p.add_argument("--hf-n", type=int, default=48, help="requests for HF generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--out", default=None)
    p.add_argument(
        "--contender",
        choices=["engine-off", "engine-on", "engine-variant", "queue", "hf"],
        help=argparse.SUPPRESS,
    )
    p.add_argument("--workload", help=argparse.SUPPRESS)
    ns = p.parse_args()

    import workload as wl

    if ns.contender:  # one contender, in this process
        lines = [orjson.loads(x) for x in Path(ns.workload).read_bytes().splitlines()][: ns.n]
        if ns.contender == "queue":
            part = Path(ns.workload).with_name("part.jsonl")
            part.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
            res = run_queue(lines, ns.dtype, part)
        elif ns.contender == "hf":
            res = run_hf(lines, ns.dtype)
        else:
            res = run_engine(lines, ns.dtype, ns.contender != "engine-off", ns.contender != "engine-variant")
        Path(ns.out).write_bytes(orjson.dumps(res))
        return 0

    from bench import machine, resolve_dtypes

    ns.dtype, variant_dtype = resolve_dtypes(ns.dtype)
    lines = wl.fewshot(ns.n, ns.seed)
    info: dict[str, Any] = {"machine": machine(), "dtype": ns.dtype, "requests": ns.n, "seed": ns.seed}
    info["shared_prefix_tokens"] = prompt_tokens([{"messages": lines[0]["messages"][:1]}])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fewshot.jsonl"
        path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        off = contender("engine-off", path, ns.off_n, ns.dtype)
        on = contender("engine-on", path, ns.n, ns.dtype)
        # what batch invariance costs: the fastest kernels (cascade attention over the shared prefix)
        variant = contender("engine-variant", path, ns.n, variant_dtype)
        queue = contender("queue", path, ns.n, ns.dtype)
        hf = contender("hf", path, ns.hf_n, ns.dtype)
    rows = [on, variant, off, queue, hf]
    info["batch_invariance_cost"] = 1 - on["requests_per_s"] / variant["requests_per_s"]
    info["prefix_cache_speedup"] = on["prompt_tokens_per_s"] / off["prompt_tokens_per_s"]
    info["queue_vs_hf"] = queue["requests_per_s"] / hf["requests_per_s"]
    info["rerun_speedup"] = queue["wall_s"] / queue["rerun_wall_s"]
    common = [k for k in hf["texts"] if k in on["texts"]]
    info["greedy_equal_to_hf"] = f"{sum(on['texts'][k] == hf['texts'][k] for k in common)}/{len(common)}"
    info["cache_on_equal_to_off"] = (
        f"{sum(on['texts'][k] == off['texts'][k] for k in off['texts'])}/{len(off['texts'])}"
    )
    for r in rows:
        r.pop("texts", None)
    info["rows"] = rows
    print()
    print(table(info, rows, hf["requests_per_s"]))
    print()
    print(
        f"prefix cache: {info['prefix_cache_speedup']:.1f}x the prompt tokens/s of the cache-off engine "
        f"(texts equal to cache off: {info['cache_on_equal_to_off']}; to HF: {info['greedy_equal_to_hf']})"
    )
    print(f"queue path: {info['queue_vs_hf']:.1f}x HF generate's requests/s")
    print(f"batch invariance (the default) costs {100 * info['batch_invariance_cost']:.1f}% of requests/s against "
          "batch_invariant = false")  # fmt: skip
    print(f"rerun of the same batch: {queue['rerun_wall_s']:.2f}s, {info['rerun_speedup']:.0f}x faster than the "
          f"first run ({queue['rerun_from_result_cache']}/{ns.n} from the result cache, "
          f"{queue['rerun_texts_equal']}/{ns.n} texts equal)")  # fmt: skip
    out = Path(ns.out) if ns.out else ROOT / "benchmarks" / "results" / f"fewshot-{ns.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
