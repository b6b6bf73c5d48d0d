"""One prepared GPU check: hardware, kernel tests, greedy parity with HF, bitwise batch invariance, the engine's
own throughput with host ms per step, the GPU's idle share and the roofline's share (nano-vllm's shape on an
8B and a 0.6B; labeling with choices over a shared instruction on a 1B), throughput vs HF and what
invariance costs (8B), Q4 (1B).

    python benchmarks/gpu_check.py                # on the GPU (what gpu_check.sh runs), < 9 min
    python benchmarks/gpu_check.py --stages parity,bench:llama-8b   # a rerun of some stages only
    python benchmarks/gpu_check.py --tiny         # the whole flow on CPU with tiny models, < 2 min

Each stage runs in its own process under a hard timeout (a hung or crashed stage is reported and the
next one runs, with its GPU memory freed). Results: a table on stdout, JSON in $OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Stage budgets in seconds (hard timeouts). A lent GPU gives a task 15 minutes, start-up included: the
# whole check (~6 min) must leave room for a rerun of what failed (--stages).
GPU_STAGES = [("kernels", 100), ("parity", 35), ("invariance", 35), ("throughput:llama-8b", 100),
              ("throughput:qwen3-0.6b", 50), ("labeling:llama-1b", 45), ("bench:llama-8b", 100),
              ("quant:llama-1b", 35)]  # fmt: skip
TINY_STAGES = [("parity", 40), ("invariance", 40), ("quant:tiny", 30), ("bench:tiny", 50),
               ("throughput:tiny", 40), ("labeling:tiny", 40)]  # fmt: skip
# The H200's roofline: HBM3e bandwidth and the dense bf16 tensor-core peak (no sparsity).
H200_BYTES_S, H200_FLOPS = 4.8e12, 989e12


def hardware() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "transformers": transformers.__version__, "python": sys.version.split()[0]}  # fmt: skip
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


# ------------------------------------------------------------------------------------------ stages


def stage_kernels(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if args.device == "cuda":  # the C kernels' tests say nothing about the GPU, and CI runs them
        cpu_only = ("test_cpu_", "test_native_", "test_decode_stack")
        cmd += sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests/kernels").glob("test_*.py")
                      if not f.name.startswith(cpu_only))  # fmt: skip
        cmd.append("tests/engine/test_cuda_graph_logic.py")  # graphs' replay, overlapped and serial
    else:
        cmd.append("tests/kernels")
    cmd += ["-rfE", "--durations=5"]
    if args.device == "cuda" and importlib.util.find_spec("xdist"):  # Triton's compiles dominate: spread them
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    # Output goes to a file as it comes, so a run cut at the budget still says how far it got; with $OUT set,
    # the whole log comes back (the tail below cannot hold every failure's traceback).
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    path = Path(os.environ["OUT"], "kernels.log") if os.environ.get("OUT") else None
    with open(path, "w+") if path else tempfile.TemporaryFile("w+") as log:
        try:
            rc: int | str = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           timeout=args.budget - 5).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.budget - 5}s"
        log.seek(0)
        tail = log.read().strip().splitlines()[-25:]
    return {"ok": rc == 0, "returncode": rc, "summary": tail[-1] if tail else "", "tail": tail}


def stage_parity(args: argparse.Namespace) -> dict[str, Any]:
    """Tiny random Llama through Engine.load (checkpoint in a temp dir) vs HF generate, greedy, EOS off:
    fp32 must match token for token (graphs with async scheduling, graphs serially, no graphs); bf16 is
    reported (near-ties may flip)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build_tiny_checkpoint
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    device = torch.device(args.device)
    new = 24
    prompts = [[3 + (7 * i + 13 * k) % 250 for k in range(5 + 9 * i)] for i in range(8)]  # 5..68 tokens
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp), "llama", num_hidden_layers=3, max_position_embeddings=512)
        for dtype in ("float32", "bfloat16"):
            hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
            hf = hf.to(device).eval()
            want = []
            for p in prompts:  # one prompt at a time: no padding in the reference
                ids = torch.tensor([p], device=device)
                gen = hf.generate(
                    ids, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0
                )
                want.append(gen[0, len(p) :].tolist())
            del hf
            # graphs with async scheduling (the default), graphs with serial steps, no graphs
            runs = ((True, True), (True, False), (False, True)) if device.type == "cuda" else ((False, True),)
            for graphs, overlap in runs:
                cfg = EngineConfig(model=str(path), device=args.device, dtype=dtype, kv_cache_gb=0.05,
                                   max_num_seqs=16, cuda_graphs=graphs, async_scheduling=overlap)  # fmt: skip
                engine = Engine.load(cfg)
                params = GenerationParams(max_new_tokens=new, temperature=0, ignore_eos=True)
                reqs = [EngineRequest(f"p{i}", params, prompt_token_ids=p) for i, p in enumerate(prompts)]
                got = [r.token_ids for r in engine.generate(reqs)]
                same = sum(g == w for g, w in zip(got, want, strict=True))
                prefix = [
                    next((k for k, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), new)
                    for g, w in zip(got, want, strict=True)
                ]
                key = f"{dtype}{'+graphs' if engine.model_runner.graphs is not None else ''}"
                key += "" if overlap else "+serial"
                out[key] = {
                    "identical": f"{same}/{len(prompts)}",
                    "mean_common_prefix": sum(prefix) / len(prefix),
                    "overlapped_steps": engine.stats().overlapped_steps,
                }
                del engine
    out["ok"] = all(v["identical"].split("/")[0] == v["identical"].split("/")[1]
                    for k, v in out.items() if k.startswith("float32"))  # fmt: skip
    return out


def stage_invariance(args: argparse.Namespace) -> dict[str, Any]:
    """Batch invariance in bfloat16 (the GPU default): greedy lines with logprobs on a tiny random Llama, and
    the same with every projection kept 4-bit (Triton's quantised GEMM), alone and beside 40 other lines of
    other lengths, must give bitwise-equal tokens and logprobs; the batch_invariant = false engine's
    agreement is reported beside (cuBLAS picks kernels by row count)."""
    import torch

    from benchmarks import gpu_models as gm
    from tests.tiny_models import build_tiny_checkpoint
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    new = 12
    subjects = [[5 + (11 * i + 3 * k) % 240 for k in range(7 + 13 * i)] for i in range(3)]
    others = [[9 + (5 * i + 7 * k) % 240 for k in range(3 + (17 * i) % 90)] for i in range(40)]
    params = GenerationParams(
        max_new_tokens=new, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )

    def bits(r: Any) -> tuple[Any, ...]:
        return tuple(r.token_ids), repr(
            [(lp.logprob, [c.logprob for c in lp.top]) for lp in r.logprobs or []]
        )

    def run(engine: Any, batch: list[list[int]]) -> list[tuple[Any, ...]]:
        reqs = [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(batch)]
        return [bits(r) for r in engine.generate(reqs)]

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp), "llama", num_hidden_layers=3, max_position_embeddings=512)
        for quant in (False, True):
            for invariant in (True, False):
                cfg = EngineConfig(model=str(path), device=args.device, dtype="bfloat16", kv_cache_gb=0.05,
                                   batch_invariant=invariant, prefix_cache=False)  # fmt: skip
                engine = Engine.load(cfg)
                if quant:
                    gm.quantize_rtn(engine, 4, 32)
                alone = [run(engine, [s])[0] for s in subjects]
                mixed = run(engine, [*others[:20], *subjects, *others[20:]])[20:23]
                small = run(engine, [others[0], *subjects])[1:]
                same = sum(a == b == c for a, b, c in zip(alone, mixed, small, strict=True))
                key = f"{'q4' if quant else 'bf16'}{'' if invariant else ', batch_invariant=false'}"
                out[key] = {"bitwise_equal": f"{same}/{len(subjects)}", "held": engine.batch_invariant}
                del engine
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    out["ok"] = all(v["bitwise_equal"] == f"{len(subjects)}/{len(subjects)}"
                    for k, v in out.items() if "false" not in k)  # fmt: skip
    return out


def stage_bench(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    import torch

    from benchmarks import gpu_models as gm
    from worker.engine_config import EngineConfig

    t_start = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiny = shape == "tiny"
    n = 32 if tiny else 256
    jobs = gm.workload(n, gm.SHAPES[shape]["vocab_size"])
    if tiny:  # keep the CPU dry run short: same shape of work, short outputs and prompts
        jobs = [gm.Job(j.prompt_ids[:60], min(j.max_new_tokens, 12)) for j in jobs]
    hf = gm.hf_model(shape, dtype, device)
    res: dict[str, Any] = {"model": shape, "dtype": str(dtype).removeprefix("torch."), "requests": n,
                           "build_s": round(time.perf_counter() - t_start, 1), "contenders": {}}  # fmt: skip
    left = lambda: args.budget - (time.perf_counter() - t_start) - 5  # noqa: E731
    # Shares of what is left: the engine is fastest (it stops when done), the batch_invariant = false engine
    # (what invariance costs), HF generate a third of the rest for one full batch, HF continuous batching
    # (its own warm-up included) the remainder.
    shares = [("batchq", 0.25), ("batchq_variant", 0.3), ("hf_generate", 0.35), ("hf_continuous", 1.0)]
    for name, share in shares:
        budget = max(5.0, left() * share)
        try:
            if name.startswith("batchq"):
                cfg = EngineConfig(model=shape, device=args.device, dtype=res["dtype"], kv_cache_gb=24 if not tiny else 0.05,
                                   max_num_seqs=128, max_num_batched_tokens=8192, max_model_len=1024,
                                   batch_invariant=name == "batchq")  # fmt: skip
                t0 = time.perf_counter()
                engine = gm.engine_from_hf(hf, cfg)
                setup = time.perf_counter() - t0
                r = gm.run_engine(engine, jobs, budget - setup)
                r["setup_s"] = round(setup, 1)
                del engine
                gc.collect()  # the KV pool and graph pool must be gone before HF sizes its caches
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            elif name == "hf_generate":
                r = gm.run_hf_generate(hf, jobs, [16, 64] if tiny else [128], budget)
            else:
                r = gm.run_hf_continuous(hf, jobs, budget)
        except Exception as exc:  # one contender failing must not hide the others
            r = {"error": f"{type(exc).__name__}: {exc}"}
        res["contenders"][name] = r
        print(f"  {shape} {name}: {r}", flush=True)
        if args.result:  # written as we go, so a stage killed at its timeout still reports what it measured
            Path(args.result).write_text(json.dumps(res, default=str))
    return res


class StepProbe:
    """Per step of an engine (a wrapper over its model runner's `run`): the device's time (CUDA events around
    the step's work; on a CPU its wall time) and the step's roofline time on an H200: the weights' and the
    KV cache's bytes it reads at H200_BYTES_S, or its FLOPs (2 x params per token, 4 x head dims per
    attended pair) at H200_FLOPS, whichever is longer."""

    def __init__(self, engine: Any) -> None:
        import torch

        from worker.engine.kv_pool import kv_bytes_per_token

        runner = engine.model_runner
        model = runner.model
        self.cuda = runner.device.type == "cuda"
        self.params = sum(p.numel() for p in model.parameters())
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        dtype = runner.kv_caches[0][0].dtype
        self.kv_token_bytes = kv_bytes_per_token(model, dtype)
        spec = model.spec
        self.attn_flops_per_pair = 4 * spec.num_layers * spec.num_heads * spec.head_dim
        self.events: list[tuple[Any, Any]] = []
        self.cpu_s: list[float] = []
        self.roofline_s = 0.0
        inner_run, inner_launch = runner.run, runner.launch_decode

        def timed(work: Any, *a: Any) -> Any:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = work(*a)
                end.record()
                self.events.append((start, end))
                return out
            t = time.perf_counter()
            out = work(*a)
            self.cpu_s.append(time.perf_counter() - t)
            return out

        def run(batch: Any) -> Any:
            self.count(batch)
            return timed(inner_run, batch)

        def launch_decode(batch: Any, previous: Any) -> Any:  # async scheduling: timed on the device thread
            self.count(batch)
            work = inner_launch(batch, previous)
            return lambda: timed(work)

        runner.run, runner.launch_decode = run, launch_decode

    def count(self, batch: Any) -> None:
        seqs = batch.seqs
        new = batch.num_decode + sum(batch.chunks)  # tokens this step computes
        context = sum(s.num_tokens for s in seqs)  # tokens their attention reads (an upper bound)
        flops = 2 * self.params * new + self.attn_flops_per_pair * new * (context // max(1, len(seqs)))
        bytes_ = self.weight_bytes + self.kv_token_bytes * context
        self.roofline_s += max(bytes_ / H200_BYTES_S, flops / H200_FLOPS)

    def device_s(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        return sum(self.cpu_s)


def probe_run(engine: Any, reqs: list[Any], warm: list[Any], budget_s: float) -> dict[str, Any]:
    """Run `reqs` through the engine after `warm` (compiles, graphs), measured by a StepProbe: output tok/s,
    requests done, host ms per step (a step's wall time less its device time), the device's idle share and
    the share of the H200's roofline (roofline time over wall time)."""
    engine.generate(warm)
    probe = StepProbe(engine)
    for r in reqs:
        engine.add_request(r)
    before, overlapped = engine.stats().tokens_generated, engine.stats().overlapped_steps
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    done = steps = 0
    while engine.has_work() and time.perf_counter() < deadline:
        done += len(engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    busy = probe.device_s()
    tokens = engine.stats().tokens_generated - before
    return {"tok_s": round(tokens / wall, 1), "req_s": round(done / wall, 2), "requests_done": done,
            "partial": done < len(reqs), "steps": steps, "wall_s": round(wall, 1),
            "host_ms_per_step": round((wall - busy) / max(1, steps) * 1e3, 3),
            "device_idle_share": round(1 - busy / wall, 3), "roofline_share": round(probe.roofline_s / wall, 3),
            "cuda_graphs": engine.model_runner.graphs is not None,
            "overlapped_steps": engine.stats().overlapped_steps - overlapped}  # fmt: skip


def probe_stage(
    args: argparse.Namespace,
    shape: str,
    t_start: float,
    limits: dict[str, Any],
    reqs: list[Any],
    warm: list[Any],
) -> dict[str, Any]:
    """A random `shape` model (bf16 on a GPU, float32 on a CPU) in an engine of `limits` (max_num_seqs,
    max_model_len, kv_cache_gb), `reqs` run through it after `warm` (probe_run) in what the stage's budget
    leaves since t_start."""
    import torch

    from benchmarks import gpu_models as gm
    from worker.engine_config import EngineConfig

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = gm.hf_model(shape, dtype, device)
    cfg = EngineConfig(model=shape, device=args.device, dtype=str(dtype).removeprefix("torch."),
                       max_num_batched_tokens=8192, **limits)  # fmt: skip
    engine = gm.engine_from_hf(hf, cfg)
    del hf
    gc.collect()
    res: dict[str, Any] = {"model": shape, "dtype": cfg.dtype, "requests": len(reqs),
                           "setup_s": round(time.perf_counter() - t_start, 1)}  # fmt: skip
    res.update(probe_run(engine, reqs, warm, args.budget - (time.perf_counter() - t_start) - 10))
    res["ok"] = True  # (measured; a budget run out shows as partial)
    return res


def stage_throughput(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    """nano-vllm's benchmark shape: 256 sequences, prompt and output lengths drawn from 100-1024, random
    weights in bf16, EOS off; output tok/s, host ms per step, the GPU's idle share, the roofline's share."""
    import random

    from benchmarks import gpu_models as gm
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest

    t_start = time.perf_counter()
    tiny = shape == "tiny"
    vocab = gm.SHAPES[shape]["vocab_size"]
    rng = random.Random(0)
    n, lo, hi = (32, 10, 60) if tiny else (256, 100, 1024)

    def request(tag: str, i: int) -> EngineRequest:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
        p = GenerationParams(max_new_tokens=rng.randint(lo, hi), temperature=0.0, ignore_eos=True)
        return EngineRequest(f"{tag}{i}", p, prompt_token_ids=prompt)

    warm = [request("warm", i) for i in range(8)]
    reqs = [request("r", i) for i in range(n)]
    limits = {"max_num_seqs": n, "max_model_len": 2 * hi + 16, "kv_cache_gb": 0.2 if tiny else 40}
    return probe_stage(args, shape, t_start, limits, reqs, warm)


LABELS = ("positive", "negative", "neutral")


def stage_labeling(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    """Labeling-shaped: 2,000 short requests sharing a 500-token instruction (the prefix cache holds it),
    each `choices` over three labels; req/s, host ms per step, the GPU's idle share, the roofline's share."""
    import random

    from benchmarks import gpu_models as gm
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest

    t_start = time.perf_counter()
    tiny = shape == "tiny"
    vocab = gm.SHAPES[shape]["vocab_size"]
    rng = random.Random(0)
    n, shared = (200, 100) if tiny else (2000, 500)
    instruction = [rng.randrange(3, vocab) for _ in range(shared)]
    params = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)

    def request(tag: str, i: int) -> EngineRequest:
        text = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))]
        return EngineRequest(f"{tag}{i}", params, prompt_token_ids=instruction + text)

    warm = [request("warm", i) for i in range(8)]
    reqs = [request("r", i) for i in range(n)]
    limits = {"max_num_seqs": 256, "max_model_len": 1024, "kv_cache_gb": 0.2 if tiny else 20}
    return probe_stage(args, shape, t_start, limits, reqs, warm)


def stage_quant(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    """Weights kept 4-bit on the GPU (every projection, groups of 128, through Triton's quantised GEMM)
    against the same engine holding those weights dequantised (bf16, F.linear): greedy agreement and
    output tok/s of each on the same jobs."""
    import torch

    from benchmarks import gpu_models as gm
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    t_start = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiny = shape == "tiny"
    jobs = gm.workload(16 if tiny else 128, gm.SHAPES[shape]["vocab_size"])
    jobs = [gm.Job(j.prompt_ids[:200], min(j.max_new_tokens, 12 if tiny else 64)) for j in jobs]
    hf = gm.hf_model(shape, dtype, device)
    cfg = EngineConfig(model=shape, device=args.device, dtype=str(dtype).removeprefix("torch."),
                       kv_cache_gb=0.05 if tiny else 16, max_num_seqs=128, max_model_len=1024)  # fmt: skip
    res: dict[str, Any] = {"model": shape, "bits": 4, "group": 128 if not tiny else 32}
    engines = {}
    for name in ("q4", "dequantised"):
        e = gm.engine_from_hf(hf, cfg)
        res["layers"] = gm.quantize_rtn(e, 4, res["group"])
        if name == "dequantised":
            e.model_runner.model.dequantize_weights(dtype)  # type: ignore[operator]
        engines[name] = e
    params = GenerationParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for name, e in engines.items():
        reqs = [
            EngineRequest(f"p{i}", params, prompt_token_ids=j.prompt_ids) for i, j in enumerate(jobs[:16])
        ]
        outs[name] = [r.token_ids for r in e.generate(reqs)]
    res["identical"] = f"{sum(a == b for a, b in zip(outs['q4'], outs['dequantised'], strict=True))}/16"
    for name, e in engines.items():
        left = args.budget - (time.perf_counter() - t_start) - 5
        res[name] = gm.run_engine(e, jobs, max(5.0, left / (2 if name == "q4" else 1)))
        print(f"  {shape} quant {name}: {res[name]}", flush=True)
        if args.result:
            Path(args.result).write_text(json.dumps(res, default=str))
    res["ok"] = res["identical"].startswith(("16", "15", "14"))  # bf16 near-ties may flip a few
    return res


def run_stage(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "kernels":
        return stage_kernels(args)
    if name == "invariance":
        return stage_invariance(args)
    if name == "parity":
        return stage_parity(args)
    if name.startswith("quant:"):
        return stage_quant(args, name.split(":", 1)[1])
    if name.startswith("throughput:"):
        return stage_throughput(args, name.split(":", 1)[1])
    if name.startswith("labeling:"):
        return stage_labeling(args, name.split(":", 1)[1])
    return stage_bench(args, name.split(":", 1)[1])


# ------------------------------------------------------------------------------------------ driver


def spawn(name: str, budget: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    result_file = out_dir / f"{name.replace(':', '_')}.json"
    cmd = [sys.executable, __file__, "--stage", name, "--budget", str(budget), "--device", args.device,
           "--result", str(result_file)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=budget + 15, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        stderr = proc.stderr.strip().splitlines()[-12:]
        error = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        stderr, error = [], f"timed out after {budget + 15}s"
    res: dict[str, Any] = {"ok": False, "error": error, "stderr": stderr}
    if result_file.exists():
        res = {**json.loads(result_file.read_text()), **({} if error == "exit 0" else {"error": error})}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def report(hw: dict[str, Any], results: dict[str, Any]) -> None:
    print("\n== hardware:", ", ".join(f"{k}={v}" for k, v in hw.items()))
    for name in [n for n in results if n.startswith("quant:")]:
        r = results[name]
        tok = {
            k: round(r[k]["tok_s"])
            for k in ("q4", "dequantised")
            if isinstance(r.get(k), dict) and "tok_s" in r[k]
        }
        print(f"== {name}: {'PASS' if r.get('ok') else 'FAIL'} ({r.get('wall_s')}s) greedy identical "
              f"{r.get('identical')}, tok/s {tok} {r.get('error', '')}")  # fmt: skip
    for name in ("kernels", "parity", "invariance"):
        if name in results:
            r = results[name]
            detail = (
                r.get("summary") or r.get("error") or {k: v for k, v in r.items() if k not in ("ok", "tail")}
            )
            print(f"== {name}: {'PASS' if r.get('ok') else 'FAIL'} ({r.get('wall_s')}s) {detail}")
            if not r.get("ok"):
                print("\n".join("   " + line for line in r.get("tail", [])))
    for name in [n for n in results if n.startswith(("throughput:", "labeling:"))]:
        r = results[name]
        keys = ("tok_s", "req_s", "requests_done", "partial", "steps", "host_ms_per_step", "device_idle_share",
                "roofline_share", "cuda_graphs", "overlapped_steps", "error")  # fmt: skip
        print(f"== {name} ({r.get('wall_s')}s): " + ", ".join(f"{k}={r[k]}" for k in keys if k in r))
    print(f"\n{'model':<10} {'contender':<14} {'output tok/s':>12} {'vs batchq':>10}  notes")
    for name, r in results.items():
        if not name.startswith("bench:"):
            continue
        cont = r.get("contenders", {})
        if not cont:
            print(f"{name[6:]:<10} {'-':<14} {'-':>12} {'-':>10}  {r.get('error')} {r.get('stderr', '')}")
        ours = cont.get("batchq", {}).get("tok_s")
        for c, v in cont.items():
            tps = v.get("tok_s")
            ratio = f"{tps / ours:.2f}x" if tps and ours else "-"
            notes = v.get("error") or ", ".join(
                f"{k}={v[k]}" for k in ("batch_size", "requests_done", "partial", "cuda_graphs") if k in v
            )
            print(f"{name[6:]:<10} {c:<14} {tps or 0:>12.0f} {ratio:>10}  {notes}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="dry run: tiny models on CPU, torch backend, < 1 min")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (--tiny)")
    p.add_argument("--stages", help="comma-separated stage names to run (default: all), e.g. a rerun")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=60, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.stage:  # child process: run one stage, write its JSON
        res = run_stage(args.stage, args)
        Path(args.result).write_text(json.dumps(res, indent=1, default=str))
        return 0
    t0 = time.perf_counter()
    hw = hardware()
    print("hardware:", json.dumps(hw), flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stages = TINY_STAGES if args.tiny else GPU_STAGES
        if args.stages:
            wanted = args.stages.split(",")
            unknown = sorted(set(wanted) - {n for n, _ in stages})
            if unknown:
                p.error(f"--stages: unknown {unknown}; known: {[n for n, _ in stages]}")
            stages = [(n, b) for n, b in stages if n in wanted]
        for name, budget in stages:
            print(f"-- {name} (budget {budget}s)", flush=True)
            results[name] = spawn(name, budget, args, Path(tmp))
    report(hw, results)
    summary = {"hardware": hw, "results": results, "total_s": round(time.perf_counter() - t0, 1)}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\ntotal {summary['total_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
