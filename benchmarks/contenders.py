"""The contenders of bench.py, each run in its own process so peak RSS and threads are its own.

python benchmarks/contenders.py engine WORKLOAD.jsonl OUT.json --dtype float32 [--dequantised [--weight-dtype int8]]
python benchmarks/contenders.py hf WORKLOAD.jsonl OUT.json --dtype float32
python benchmarks/contenders.py queue WORKLOAD.jsonl OUT.json --dtype float32
python benchmarks/contenders.py llamacpp WORKLOAD.jsonl OUT.json   # optional: pip install llama-cpp-python

Besides the workload, the engine and HF each measure decode alone at batch 1, 8 and 16, llama.cpp at
batch 1 (DECODE_TOKENS new tokens after one short chat prompt, EOS ignored): a batch job's tail runs at
these sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
DECODE_PROMPT = [{"role": "user", "content": "Count slowly from one to one hundred."}]
DECODE_TOKENS = 128
DECODE_BATCHES = (1, 8, 16)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _summary(name: str, wall: float, tokens: int, n: int, ttfts: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "requests": n,
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "requests_per_s": n / wall,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p95_s": _pct(ttfts, 0.95),
        **extra,
    }


def load_lines(path: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


# --------------------------------------------------------------------------- engine
def engine_decode_rate(engine: Any, batch: int, new_tokens: int) -> float:
    """Output tok/s of `batch` sequences decoding together: short prompts, then only decode steps timed."""
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest

    for i in range(batch):
        params = GenerationParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"decode{batch}-{i}", params, messages=DECODE_PROMPT))
    while engine.stats().waiting or not all(s.prefilled for s in engine.scheduler.running):
        engine.step()  # every prompt admitted and computed (the first tokens decode alongside the last chunks)
    assert engine.stats().running == batch, f"the batch of {batch} did not fit the KV pool"
    gen0, t0 = engine.stats().tokens_generated, time.perf_counter()
    while engine.has_work():
        engine.step()
    return float((engine.stats().tokens_generated - gen0) / (time.perf_counter() - t0))


def run_engine(
    lines: list[dict[str, Any]],
    dtype: str,
    max_num_seqs: int,
    full_batch: int,
    kv_cache_dtype: str = "auto",
    weight_dtype: str = "auto",
    dequantised: bool = False,
    batch_invariant: bool = True,
    async_scheduling: bool = True,
) -> dict[str, Any]:
    """dequantised: the model from Hugging Face's float32 dequantisation of its GGUF (what weight_dtype
    narrows; the default keeps the file's Q4_1 / Q8_0 weights as they ship). batch_invariant False: the
    fastest kernels, whose rounding may follow the batch (what invariance costs). async_scheduling False:
    every step serial (what the overlap gains or costs)."""
    from benchmarks.bench import memory_bandwidth
    from worker.engine.engine import Engine
    from worker.engine.kv_pool import kv_bytes_per_token
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig
    from worker.models.resolve import hf_checkpoint

    model_ref = hf_checkpoint(MODEL) if dequantised else MODEL
    t0 = time.perf_counter()
    engine = Engine.load(
        EngineConfig(
            model=model_ref,
            device="cpu",
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            weight_dtype=weight_dtype,
            batch_invariant=batch_invariant,
            async_scheduling=async_scheduling,
        )
    )
    load_s = time.perf_counter() - t0

    def reqs(ls: list[dict[str, Any]], started_at: float | None = None, **over: Any) -> list[EngineRequest]:
        out = []
        for ln in ls:
            params = GenerationParams(max_new_tokens=ln["max_new_tokens"], temperature=0, **over)
            out.append(EngineRequest(ln["id"], params, messages=ln["messages"], started_at=started_at))
        return out

    engine.generate(reqs(lines[:4]))  # warm-up (allocator, kernels)
    batch = reqs(lines, started_at=time.monotonic())
    t0 = time.perf_counter()
    results = engine.generate(batch)
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]

    peak_rss = _peak_rss_mb()
    decode_rates = {str(b): engine_decode_rate(engine, b, DECODE_TOKENS) for b in DECODE_BATCHES}
    # the decode rows' bound, measured right after them: a VM's bandwidth moves within minutes
    bandwidth = memory_bandwidth()
    prompt = DECODE_PROMPT
    text = engine.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    prompt_len = len(engine.tokenizer(text, add_special_tokens=False).input_ids)
    kv_bytes = kv_bytes_per_token(engine.model_runner.model, engine.model_runner.kv_caches[0][0].dtype)
    pool_mb = engine.stats().kv_blocks_total * engine.cfg.block_size * kv_bytes / 2**20
    model = engine.model_runner.model
    linears = model.linears()
    # packed weights hold padding columns: count the model's own parameters, and the bytes a step streams
    params = sum(p.numel() for p in model.parameters()) - sum(lin.weight.numel() for lin in linears)
    params += sum(lin.in_features * lin.out_features for lin in linears)
    weight_bytes = sum(
        lin.weight.nbytes + sum(0 if t is None else t.nbytes for t in (lin.scale, lin.group_table))
        for lin in linears
    )
    flops = workload_flops(engine.model_runner.model, results, params)
    kv_blocks = engine.stats().kv_blocks_total
    del engine
    name = "batchq engine"
    if kv_cache_dtype != "auto":
        name += f", {kv_cache_dtype} KV cache"
    if weight_dtype != "auto":
        name += f", {weight_dtype} weights"
    elif dequantised:
        name += ", float32 weights (dequantised GGUF)"
    if not batch_invariant:
        name += f", {dtype}, batch_invariant = false"
    summary = _summary(
        name,
        wall,
        tokens,
        len(results),
        ttfts,
        load_s=load_s,
        peak_rss_mb=peak_rss,
        texts={r.request_id: r.text for r in results},
        token_ids={r.request_id: r.token_ids for r in results},
        kv_pool_mb=pool_mb,
        kv_blocks=kv_blocks,
        params=params,
        weight_bytes=weight_bytes,
        memory_bandwidth=bandwidth,
        workload_flops=flops,
        decode_tokens_per_s=decode_rates,
    )
    if full_batch == 0:
        return summary

    # Decode at the largest batch: full_batch short prompts, then only decode steps are timed.
    # A pool that holds every sequence's whole reservation at once (the default 1 GB holds 237 of 256
    # in float32), so every measured step decodes the full batch.
    need = full_batch * (prompt_len + 48 + 16) * kv_bytes
    big = Engine.load(
        EngineConfig(
            model=model_ref,
            device="cpu",
            dtype=dtype,
            max_num_seqs=full_batch,
            kv_cache_gb=need / 1024**3,
            kv_cache_dtype=kv_cache_dtype,
            weight_dtype=weight_dtype,
            batch_invariant=batch_invariant,
        )
    )
    decode_tps = engine_decode_rate(big, full_batch, 48)
    return {**summary, "full_batch_tokens_per_s": decode_tps, "full_batch_size": full_batch}


def workload_flops(model: Any, results: list[Any], params: int) -> dict[str, float]:
    """The arithmetic the workload needs at least, counted from what the engine computed: 2 x the
    non-embedding parameters per prompt token computed (cached ones cost nothing), 2 x all parameters
    per generated token (the LM head runs on each), and attention: QK^T and PV over the context each
    computed token sees (4 x layers x query heads x head_dim per token of context). `params`: the model's
    own count (its packed or 4-bit weights' element counts are not)."""
    spec = model.spec
    embed = spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2)
    per_ctx = 4 * spec.num_layers * spec.num_heads * spec.head_dim
    prompt = gen = ctx = 0
    for r in results:
        p, g, c = r.prompt_tokens, r.completion_tokens, r.cached_tokens
        prompt += p - c
        gen += g
        ctx += sum(range(c + 1, p + 1)) + sum(range(p, p + g))  # context seen by each computed token
    return {
        "prompt_tokens_computed": prompt,
        "generated_tokens": gen,
        "gemm": 2.0 * (params - embed) * prompt + 2.0 * params * gen,
        "attention": float(per_ctx * ctx),
    }


# --------------------------------------------------------------------------- HF generate
def run_hf(lines: list[dict[str, Any]], dtype: str, sweep_s: float) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    from worker.models.resolve import hf_checkpoint

    ckpt = hf_checkpoint(MODEL)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(ckpt)
    model.eval()
    tok.padding_side = "left"
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    texts = [
        tok.apply_chat_template(ln["messages"], add_generation_prompt=True, tokenize=False) for ln in lines
    ]

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.t: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    class Progress:
        """Batches run so far at one batch size: the sweep's batches count towards the full run."""

        def __init__(self) -> None:
            self.next, self.tokens, self.wall = 0, 0, 0.0
            self.ttfts: list[float] = []
            self.outs: dict[str, str] = {}

    def run(p: Progress, bs: int, budget: float | None) -> None:
        eos_ids = eos if isinstance(eos, list) else [eos]
        t_start = time.perf_counter()
        while p.next < len(lines):
            chunk = list(range(p.next, min(p.next + bs, len(lines))))
            enc = tok([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            ft = FirstToken()
            t0 = time.perf_counter()
            with torch.inference_mode():
                gen = model.generate(
                    **enc,
                    max_new_tokens=max(lines[i]["max_new_tokens"] for i in chunk),
                    do_sample=False,
                    pad_token_id=pad,
                    logits_processor=LogitsProcessorList([ft]),
                )
            p.wall += time.perf_counter() - t0
            new = gen[:, enc["input_ids"].shape[1] :]
            for row, i in enumerate(chunk):
                ids = new[row].tolist()[: lines[i]["max_new_tokens"]]
                cut = next((k + 1 for k, t in enumerate(ids) if t in eos_ids), None)
                ids = ids[:cut] if cut else ids
                p.tokens += len(ids)
                p.outs[lines[i]["id"]] = tok.decode(ids, skip_special_tokens=True)
                # All requests are there at t=0, like the engine's: a batch waits for the ones before it.
                p.ttfts.append(p.wall - (time.perf_counter() - (ft.t or time.perf_counter())))
            p.next = chunk[-1] + 1
            if budget is not None and time.perf_counter() - t_start > budget:
                break

    progress: dict[int, Progress] = {}
    sweep: dict[str, float] = {}
    for bs in (1, 8, 16, 32, 64):
        progress[bs] = p = Progress()
        run(p, bs, sweep_s)
        sweep[str(bs)] = p.tokens / p.wall
        print(
            f"    HF bs={bs}: {sweep[str(bs)]:.1f} tok/s over {p.next} requests", file=sys.stderr, flush=True
        )
    best = max(progress, key=lambda b: sweep[str(b)])
    p = progress[best]
    run(p, best, None)
    decode_rates = {str(b): hf_decode_rate(model, tok, b, pad) for b in DECODE_BATCHES}
    tokens, wall, ttfts, outs = p.tokens, p.wall, p.ttfts, p.outs
    return _summary(
        f"HF generate (bs={best})",
        wall,
        tokens,
        len(lines),
        ttfts,
        peak_rss_mb=_peak_rss_mb(),
        texts=outs,
        sweep_tokens_per_s=sweep,
        batch_size=best,
        decode_tokens_per_s=decode_rates,
    )


def hf_decode_rate(model: Any, tok: Any, batch: int, pad: int) -> float:
    """HF generate's decode tok/s at `batch`: a DECODE_TOKENS + 1 token generation minus a 1-token one
    (the prefill), the better of two tries."""
    import torch

    text = tok.apply_chat_template(DECODE_PROMPT, add_generation_prompt=True, tokenize=False)
    enc = tok([text] * batch, return_tensors="pt", add_special_tokens=False)

    def timed(new: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t0

    best = min(timed(DECODE_TOKENS + 1) - timed(1) for _ in range(2))
    return batch * DECODE_TOKENS / best


# --------------------------------------------------------------------------- llama.cpp
def run_llamacpp(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp (llama-cpp-python) on the same GGUF the engine loads (SmolLM2-135M-Instruct, Q4_1), the
    same prompt tokens (HF's chat template and tokenizer), greedy, EOS honoured. Its Python API decodes
    one sequence at a time, so the workload runs request after request and batch 8 is not measured."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python to add it)"}
    import torch
    from transformers import AutoTokenizer

    from worker.models.resolve import resolve_checkpoint, smollm2_gguf_path

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint(MODEL))
    threads = torch.get_num_threads()
    llm = Llama(
        model_path=str(smollm2_gguf_path()), n_ctx=4096, n_batch=512, n_threads=threads, verbose=False
    )
    eos = {llm.token_eos(), *([tok.eos_token_id] if tok.eos_token_id is not None else [])}

    def generate(ids: list[int], max_new: int, stop_at_eos: bool) -> tuple[list[int], float | None]:
        out: list[int] = []
        first: float | None = None
        for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            if stop_at_eos and t in eos:
                break
            out.append(t)
            if len(out) >= max_new:
                break
        return out, first

    def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False).input_ids)

    generate(prompt_ids(lines[0]["messages"]), 4, True)  # warm-up
    tokens, ttfts, texts = 0, [], {}
    t0 = time.perf_counter()
    for ln in lines:
        ids, first = generate(prompt_ids(ln["messages"]), ln["max_new_tokens"], True)
        tokens += len(ids)
        ttfts.append((first or time.perf_counter()) - t0)  # all requests are there at t=0
        texts[ln["id"]] = tok.decode(ids, skip_special_tokens=True)
    wall = time.perf_counter() - t0
    decode_ids = prompt_ids(DECODE_PROMPT)
    best = float("inf")
    for _ in range(2):
        ids, first = generate(decode_ids, DECODE_TOKENS + 1, False)
        best = min(best, time.perf_counter() - (first or 0.0))
    return _summary(
        "llama.cpp (Q4_1 GGUF, one sequence at a time)",
        wall,
        tokens,
        len(lines),
        ttfts,
        peak_rss_mb=_peak_rss_mb(),
        texts=texts,
        decode_tokens_per_s={"1": DECODE_TOKENS / best},
    )


# --------------------------------------------------------------------------- full queue path
def run_queue(lines: list[dict[str, Any]], dtype: str, max_num_seqs: int, workload: str) -> dict[str, Any]:
    import asyncio

    from worker.embedded_redis import RedisServer

    with RedisServer() as server:
        env = {**os.environ, "REDIS_URL": server.url}
        log = open(Path(workload).with_suffix(".worker.log"), "w")  # noqa: SIM115
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "--model", MODEL, "--device", "cpu", "--dtype", dtype,
             "--queue", "bench", "--max-num-seqs", str(max_num_seqs), "--log-interval-s", "5"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        try:
            return asyncio.run(_queue_client(server.url, lines, workload, worker))
        finally:
            worker.terminate()
            worker.wait(60)
            log.close()


async def _queue_client(url: str, lines: list[dict[str, Any]], workload: str, worker: Any) -> dict[str, Any]:
    from producer.client.batchq_client import BatchqClient

    client = BatchqClient.from_url(url)
    try:
        deadline = time.monotonic() + 600
        while not await client.redis.keys("batchq:worker:*"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start")
            await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        report = await client.submit_file(workload, queue="bench")
        await client.wait(report.batch_id, timeout=3600)
        wall = time.perf_counter() - t0
        results = [r async for r in client.results(report.batch_id)]
        rss = _proc_peak_rss_mb(worker.pid)
    finally:
        await client.close()
    tokens = sum(r.usage.completion_tokens for r in results)
    ttfts = [(r.timing.queued_s or 0) + r.timing.ttft_s for r in results if r.timing.ttft_s is not None]
    return _summary(
        "queue: submit+worker+results", wall, tokens, len(results), ttfts, peak_rss_mb=rss,
        texts={r.id: r.text for r in results},
    )  # fmt: skip


def _proc_peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "hf", "queue", "llamacpp"])
    p.add_argument("workload")
    p.add_argument("out")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--hf-sweep-s", type=float, default=20.0)
    p.add_argument(
        "--full-batch", type=int, default=256, help="sequences in the decode-rate measurement (0: skip it)"
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument(
        "--dequantised", action="store_true", help="the GGUF's float32 dequantisation (weight_dtype's source)"
    )
    p.add_argument(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="the engine with batch_invariant = false (the fastest kernels, whose rounding may follow the batch)",
    )
    p.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="the engine with async_scheduling = false (every step serial)",
    )
    ns = p.parse_args()
    from worker.platform.cpu_settings import cap_libraries

    cap_libraries()  # BATCHQ_CPU_ISA=avx2: HF's GEMMs as on an AVX2-only machine too, before any matmul
    lines = load_lines(ns.workload)
    if ns.mode == "engine":
        res = run_engine(
            lines,
            ns.dtype,
            ns.max_num_seqs,
            ns.full_batch,
            ns.kv_cache_dtype,
            ns.weight_dtype,
            ns.dequantised,
            ns.batch_invariant,
            ns.async_scheduling,
        )
    elif ns.mode == "llamacpp":
        res = run_llamacpp(lines)
    elif ns.mode == "hf":
        res = run_hf(lines, ns.dtype, ns.hf_sweep_s)
    else:
        res = run_queue(lines, ns.dtype, ns.max_num_seqs, ns.workload)
    Path(ns.out).write_bytes(orjson.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
