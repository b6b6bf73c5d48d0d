"""batchq vs HF transformers `generate`, and the full queue path, on one standard workload.

    make bench                       # = python benchmarks/bench.py
    python benchmarks/bench.py -n 256 --dtype bfloat16

Prints a table (first lines: the machine) and writes benchmarks/results/bench-<dtype>.json.
Every contender runs in its own process on the same prompts, model, dtype, max_new_tokens and greedy
decoding, EOS honoured.
"""

from __future__ import annotations

import argparse
import os
import platform
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

SMOLLM2_PARAMS = 134_515_008  # counted from the checkpoint; tied embeddings counted once


# The CPU features the kernels' speed turns on, recorded with every run.
CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "amx_int8",
)


def isa_kernels() -> list[dict[str, Any]]:
    """The CPU linear kernel per instruction set it can be built for here (native; AVX2 too where AVX-512
    exists): decode rows' time against the weight-streaming / FMA bound, and a prompt-sized GEMM's share of
    that ISA's FMA peak (benchmarks/kernel_bench.py --linear, one process per ISA)."""
    from worker.platform.cpu_settings import LIBRARY_CAPS

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isas = ["native"] + (["avx2"] if " avx512f " in f" {flags} " else [])
    out = []
    for isa in isas:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_bench.py"), "--linear", "--rows", "1,8,16",
                   "--passes", "3", "--json", f.name]  # fmt: skip
            # each ISA's process caps torch's libraries as that ISA's machine would (none for native), so
            # the native one drops the caps this process set for a forced ISA
            caps = {(k, v) for c in LIBRARY_CAPS.values() for k, v in c.items()}
            env = {k: v for k, v in os.environ.items() if (k, v) not in caps}
            proc = subprocess.run(cmd, env={**env, "BATCHQ_CPU_ISA": isa}, capture_output=True, check=False)
            if proc.returncode != 0:
                print(f"kernel_bench for {isa} failed: {proc.stderr.decode()[-500:]}")
                continue
            out.append(orjson.loads(Path(f.name).read_bytes()))
    return out


def moe_row() -> dict[str, Any] | None:
    """A small random MoE (Qwen3-MoE) on the engine against HF generate (benchmarks/moe_model_bench.py, in
    a process of its own)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "moe_model_bench.py"), "--json", f.name]
        proc = subprocess.run(cmd, capture_output=True, check=False)
        if proc.returncode != 0:
            print(f"moe_model_bench failed: {proc.stderr.decode()[-500:]}")
            return None
        out: dict[str, Any] = orjson.loads(Path(f.name).read_bytes())
        return out


def side_measurements(skip: list[str]) -> dict[str, Any]:
    """The figures beside the contenders' table: producer submit's rate, the linear kernel per ISA, the MoE
    row."""
    out: dict[str, Any] = {}
    if "enqueue" not in skip:
        out["enqueue"] = enqueue_rate()
    if "isa" not in skip:
        out["isa_kernels"] = isa_kernels()
    if "moe" not in skip and (moe := moe_row()) is not None:
        out["moe"] = moe
    return out


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, Any]:
    import torch

    cpu = cpu_name()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    from worker.kernels.native_build import cpu_isa
    from worker.platform.cpu_settings import LIBRARY_CAPS

    isa = cpu_isa()
    return {
        "cpu": cpu,
        "isa": isa,
        "library_caps": {k: os.environ[k] for k in LIBRARY_CAPS[isa] if k in os.environ},
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_bf16" in flags,
        "flags": [f for f in CPU_FLAGS if f" {f} " in f" {flags} "],
        "python": platform.python_version(),
    }


def gemm_ceiling(dtype: str, n: int = 2048, reps: int = 10, native: bool = False) -> float:
    """FLOP/s of a large square matmul in `dtype`: the machine's practical GEMM ceiling. native (float32):
    the better of torch's matmul and the engine's own C kernel (linear.c), which runs faster on some CPUs."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=dt)
    b = torch.randn(n, n, dtype=dt)
    for _ in range(2):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    best = 2 * n**3 * reps / (time.perf_counter() - t0)
    if native and dt == torch.float32:
        from worker.platform.probes import native_gemm_flops

        best = max(best, native_gemm_flops(n // 2))
    return best


def memory_bandwidth(passes: int = 20) -> float:
    """Bytes/s of reading a 512 MB float32 tensor (torch's sum, all threads): the memory-bandwidth bound's
    denominator. A VM's figure moves between runs (50-77 GB/s on 2 Zen 5 cores): compare within one run."""
    import torch

    big = torch.randn(128 * 1024 * 1024)  # far beyond any cache
    big.sum()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.numel() * 4 / best


def enqueue_rate(n: int = 100_000) -> dict[str, Any]:
    """`producer submit` (the real CLI, validation included) on n lines into a local Redis."""
    from worker.embedded_redis import RedisServer

    with tempfile.TemporaryDirectory() as d, RedisServer() as server:
        path = Path(d) / "big.jsonl"
        with path.open("wb") as f:
            for i in range(n):
                f.write(
                    orjson.dumps({"id": f"r{i}", "prompt": f"Label this text number {i}.", "max_tokens": 8})
                )
                f.write(b"\n")
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "producer.cli",
                "submit",
                str(path),
                "--redis-url",
                server.url,
                "--queue",
                "enq",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
        wall = time.perf_counter() - t0
    return {"lines": n, "wall_s": wall, "lines_per_s": n / wall}


def optional_contender(mode: str, workload: Path, dtype: str) -> dict[str, Any]:
    """A contender the run can do without (llama.cpp): its crash (a wheel built for another CPU dies of
    SIGILL) becomes a skipped row rather than the end of every other row's measurements."""
    try:
        return run_contender(mode, workload, dtype, [])
    except subprocess.CalledProcessError as exc:
        return {"skipped": f"its process failed ({exc.returncode})"}


def run_contender(mode: str, workload: Path, dtype: str, extra: list[str]) -> dict[str, Any]:
    out = workload.with_name(f"{mode}-{len(list(workload.parent.glob(f'{mode}*.json')))}.json")  # each kept
    print(f"  running {mode} ...", file=sys.stderr, flush=True)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "contenders.py"),
            mode,
            str(workload),
            str(out),
            "--dtype",
            dtype,
            *extra,
        ],
        check=True,
        cwd=ROOT,
    )
    return orjson.loads(out.read_bytes())


def family_row(out: Path) -> dict[str, Any]:
    """One non-Llama family (a random Gemma 2, family_bench.py), engine and HF on a model of its own, in its
    own process."""
    print("  running family_bench (random Gemma 2) ...", file=sys.stderr, flush=True)
    script = str(ROOT / "benchmarks" / "family_bench.py")
    subprocess.run([sys.executable, script, "--out", str(out)], check=True, cwd=ROOT)
    return dict(orjson.loads(out.read_bytes()))


def diverged(k: dict[str, Any]) -> str:
    """Where the requests whose text differs part from the reference, on average ('' where none does)."""
    if k["identical"] == k["requests"]:
        return ""
    return f", the others diverge at token {k['mean_first_divergence']:.1f} on average"


def agreement(wide: dict[str, Any], narrow: dict[str, Any]) -> dict[str, Any]:
    """Greedy outputs of a narrower KV cache or narrower weights against full precision, same prompts."""
    first = []
    for rid, a in wide["token_ids"].items():
        b = narrow["token_ids"][rid]
        if a != b:
            first.append(
                next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            )
    n = len(wide["token_ids"])
    return {
        "requests": n,
        "identical": n - len(first),
        "mean_first_divergence": sum(first) / len(first) if first else float("nan"),
        "blocks_ratio": narrow["kv_blocks"] / wide["kv_blocks"],
        "speedup": narrow["tokens_per_s"] / wide["tokens_per_s"],
        "decode_speedup": {
            b: narrow["decode_tokens_per_s"][b] / wide["decode_tokens_per_s"][b]
            for b in wide["decode_tokens_per_s"]
        },
    }


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(info: dict[str, Any], rows: list[dict[str, Any]], hf_tps: float | None) -> str:
    lines = [
        f"machine: {info['machine']['cpu']}, {info['machine']['cores']} cores, torch {info['machine']['torch']}, "
        f"dtype {info['dtype']}; CPU flags: {' '.join(info['machine']['flags']) or '-'}",
        *(
            [
                f"kernels built for {info['machine']['isa']} (BATCHQ_CPU_ISA); every contender's torch GEMMs "
                + ", ".join(f"{k}={v}" for k, v in info["machine"]["library_caps"].items())
            ]
            if info["machine"].get("isa", "native") != "native"
            else []
        ),
        f"workload: {info['requests']} requests (seed {info['seed']}), model smollm2-135m, greedy, EOS honoured",
        "",
        "| contender | output tok/s | req/s | TTFT p50 s | TTFT p95 s | peak RSS MB | vs HF |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["tokens_per_s"] / hf_tps if hf_tps else None
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | {fmt(r['ttft_p50_s'], '.2f')} | "
            f"{fmt(r['ttft_p95_s'], '.2f')} | {fmt(r.get('peak_rss_mb'), '.0f')} | "
            + ("-" if ratio is None else f"{ratio:.2f}x")
            + " |"
        )
    decode = [r for r in rows if r.get("decode_tokens_per_s")]
    if decode:
        rates = sorted(r["memory_bandwidth"] for r in decode if r.get("memory_bandwidth"))
        lines += [
            "",
            "| decode alone (128 new tokens, EOS ignored) | batch 1 tok/s | batch 8 tok/s | batch 16 tok/s "
            "| step ms at 1 / 8 / 16 | x weight-streaming bound |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in decode:
            d = r["decode_tokens_per_s"]
            steps = [int(b) / d[b] * 1e3 if d.get(b) else None for b in ("1", "8", "16")]
            bw = r.get("memory_bandwidth")
            bound_ms = r["weight_bytes"] / bw * 1e3 if bw and r.get("weight_bytes") else None
            lines.append(
                f"| {r['name']} | {fmt(d.get('1'), '.1f')} | {fmt(d.get('8'), '.1f')} | {fmt(d.get('16'), '.1f')} "
                f"| {' / '.join(fmt(x, '.1f') for x in steps)} | "
                + ("-" if bound_ms is None else " / ".join(fmt(x and x / bound_ms, ".2f") for x in steps))
                + " |"
            )
        if rates:
            lines.append(
                "(bound: the step's weight bytes read once at the memory bandwidth its process measured right "
                f"after its decode runs, {rates[0] / 1e9:.0f}-{rates[-1] / 1e9:.0f} GB/s in this run)"
            )
    if "family" in info:
        import family_bench

        lines += ["", family_bench.table(info["family"])]
    return "\n".join(lines)


def print_findings(info: dict[str, Any]) -> None:
    """The lines under the table: how the engine stands against its bounds and its narrower variants."""
    print()
    if (fb := info.get("full_batch")) is not None:
        print(
            f"full batch ({fb['batch_size']} seqs) decode: {fb['tokens_per_s']:.1f} tok/s = "
            f"{100 * fb['flops_fraction']:.1f}% of GEMM ceiling {info['gemm_ceiling_gflops']:.0f} GFLOP/s "
            f"({info['dtype']})"
        )
    pl = info["physical_limit"]
    print(
        f"physical limit: {pl['gemm'] / 1e12:.2f} TFLOP GEMM ({pl['prompt_tokens_computed']} prompt tokens computed, "
        f"{pl['generated_tokens']} generated) + {pl['attention'] / 1e12:.3f} TFLOP attention = {pl['seconds']:.1f} s "
        f"at the GEMM peak; engine time = {pl['engine_multiple']:.2f}x the limit"
    )
    for kvd, k in info["kv_cache_dtype"].items():
        print(
            f"{kvd} KV cache: {k['blocks_ratio']:.2f}x the blocks in the same memory, {k['speedup']:.2f}x the "
            f"engine's tok/s; greedy text identical to the float32 cache's for {k['identical']}/{k['requests']} "
            f"requests{diverged(k)}"
        )
    for wd, k in info["weight_dtype"].items():
        d = k["decode_speedup"]
        name = "float32 weights (the GGUF dequantised)" if wd == "auto" else f"{wd} weights (from float32)"
        print(
            f"{name}: {k['speedup']:.2f}x the engine's tok/s, decode alone {d['1']:.2f}x at batch 1 and "
            f"{d['8']:.2f}x at batch 8; greedy text identical to the engine's (the file's Q4_1 weights) for "
            f"{k['identical']}/{k['requests']} requests{diverged(k)}"
        )
    if "llamacpp" in info:
        print(f"llama.cpp: skipped, {info['llamacpp']}")
    if "batch1_vs_llamacpp" in info:
        print(
            "batch-1 decode / llama.cpp's: "
            + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in info["batch1_vs_llamacpp"].items())
        )
    if "greedy_text_equal_to_llamacpp" in info:
        print(f"greedy texts identical to llama.cpp: {info['greedy_text_equal_to_llamacpp']}")
    if "queue_vs_engine" in info:
        print(f"queue path / engine: {100 * info['queue_vs_engine']:.0f}%")
    if "worker_rss" in info:
        w = info["worker_rss"]
        print(
            f"worker peak RSS: {w['peak_mb']:.0f} MB (budget weights + KV pool + 1 GB = {w['budget_mb']:.0f} MB)"
        )
    if "greedy_text_equal_to_hf" in info:
        print(f"greedy texts identical to HF: {info['greedy_text_equal_to_hf']}")
        print(
            "HF batch-size sweep (tok/s): "
            + ", ".join(f"bs={k}: {v:.1f}" for k, v in info["hf_sweep_tokens_per_s"].items())
        )
    if "enqueue" in info:
        e = info["enqueue"]
        print(f"producer submit: {e['lines']} lines in {e['wall_s']:.2f}s = {e['lines_per_s']:.0f} lines/s")
    if (m := info.get("moe")) is not None:
        print(
            f"MoE ({m['model']}, {m['dtype']}, {m['prompts']} x {m['new_tokens']} tokens): engine "
            f"{m['engine_tokens_per_s']:.1f} tok/s, HF generate {m['hf_tokens_per_s']:.1f} = "
            f"{m['engine_vs_hf']:.2f}x; greedy equal to HF {m['greedy_equal_to_hf']} (moe_model_bench.py)"
        )
    for k in info.get("isa_kernels", []):
        rows = " / ".join(
            f"{r['ms']:.1f} ms ({100 * r['bound_ms'] / r['ms']:.0f}%)" for r in k["decode_rows"].values()
        )
        print(
            f"linear.c built for {k['isa']}: decode-step linears at {' / '.join(k['decode_rows'])} rows {rows} "
            f"of the bound; a prompt-sized GEMM at {100 * k['prompt_gemm_share_of_fma_peak']:.0f}% of the "
            f"{k['fma_peak_gflops']:.0f} GFLOP/s FMA peak (kernel_bench.py --linear)"
        )


def resolve_dtypes(requested: str) -> tuple[str, str]:
    """(the default engine row's dtype, the batch_invariant = false row's): auto takes what the engine's
    auto takes with invariance (bfloat16 where linear.c multiplies in bf16, else float32) and without it
    (bfloat16 where oneDNN's bf16 GEMMs are fast)."""
    if requested != "auto":
        return requested, requested

    from worker.platform.cpu import cpu_auto_dtype, cpu_dtype
    from worker.platform.cpu_settings import cap_libraries

    # BATCHQ_CPU_ISA=avx2: the probe below must time the capped oneDNN, as the contenders' engines do (and
    # it keeps its figure for every later start under that instruction set)
    cap_libraries()

    invariant = str(cpu_dtype("auto", "auto", invariant=True)).removeprefix("torch.")
    variant = str(cpu_auto_dtype("auto")).removeprefix("torch.")
    print(f"  dtype auto -> {invariant} (batch_invariant = false: {variant})", file=sys.stderr, flush=True)
    return invariant, variant


def print_cost(info: dict[str, Any]) -> None:
    if (cost := info.get("batch_invariance_cost")) is not None:
        print(
            f"batch invariance (the default) costs {100 * cost:.1f}% of output tok/s against batch_invariant = "
            "false (negative: the invariant engine was faster)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=256, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="one dtype for every contender; auto = the engine's CPU choice (the faster GEMM here)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--full-batch", type=int, default=256, help="batch of the decode-rate / GEMM-fraction check"
    )
    p.add_argument("--hf-sweep-s", type=float, default=20.0, help="time per batch size in HF's sweep")
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=[
            "hf", "queue", "enqueue", "kv-narrow", "weights-narrow", "llamacpp", "isa", "moe", "family", "variant"
        ],
    )  # fmt: skip
    p.add_argument("--out", default=None)
    ns = p.parse_args()

    import workload as wl
    from transformers import AutoTokenizer

    from worker.platform.cpu_settings import cap_libraries

    # BATCHQ_CPU_ISA=avx2: this process's GEMMs (the auto-dtype probe, the GEMM ceiling) as an AVX2-only
    # machine's, before its first matmul; the contenders' processes inherit the settings
    cap_libraries()
    ns.dtype, variant_dtype = resolve_dtypes(ns.dtype)

    from worker.models.resolve import resolve_checkpoint

    info: dict[str, Any] = {"machine": machine(), "dtype": ns.dtype, "requests": ns.n, "seed": ns.seed}
    with tempfile.TemporaryDirectory() as d:
        wpath = Path(d) / "workload.jsonl"
        lines = wl.generate(ns.n, ns.seed, AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m")))
        wpath.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        extra = ["--max-num-seqs", str(ns.max_num_seqs)]
        engine = run_contender("engine", wpath, ns.dtype, [*extra, "--full-batch", str(ns.full_batch)])
        rows = [engine]
        if "variant" not in ns.skip:  # what batch invariance costs: the same engine on the fastest kernels
            rows.append(
                run_contender(
                    "engine", wpath, variant_dtype, [*extra, "--full-batch", "0", "--no-batch-invariant"]
                )
            )
            info["batch_invariance_cost"] = 1 - engine["tokens_per_s"] / rows[-1]["tokens_per_s"]
        hf = (
            None
            if "hf" in ns.skip
            else run_contender("hf", wpath, ns.dtype, ["--hf-sweep-s", str(ns.hf_sweep_s)])
        )
        narrow: dict[str, dict[str, Any]] = {}
        if ns.dtype == "float32" and "kv-narrow" not in ns.skip:  # the same engine, fewer KV bytes
            for kvd in ("bfloat16", "fp8_e4m3"):
                narrow[kvd] = run_contender(
                    "engine", wpath, ns.dtype, [*extra, "--full-batch", "0", "--kv-cache-dtype", kvd]
                )
        weights: dict[str, dict[str, Any]] = {}
        if ns.dtype == "float32" and "weights-narrow" not in ns.skip:
            # the GGUF's float32 dequantisation, and it narrowed (the default row keeps the file's own Q4_1)
            for wd in ("auto", "bfloat16", "int8"):
                weights[wd] = run_contender(
                    "engine",
                    wpath,
                    ns.dtype,
                    [*extra, "--full-batch", "0", "--dequantised", "--weight-dtype", wd],
                )
        queue = None if "queue" in ns.skip else run_contender("queue", wpath, ns.dtype, extra)
        llama = None if "llamacpp" in ns.skip else optional_contender("llamacpp", wpath, ns.dtype)
        if llama is not None and "skipped" in llama:
            info["llamacpp"] = llama["skipped"]
            llama = None
        rows += [*narrow.values(), *weights.values(), *(r for r in (queue, llama, hf) if r is not None)]
        if "family" not in ns.skip:
            info["family"] = family_row(Path(d) / "family.json")
    ceiling = gemm_ceiling(ns.dtype, native=True)
    params = engine.get("params") or SMOLLM2_PARAMS
    info["gemm_ceiling_gflops"] = ceiling / 1e9
    if "full_batch_size" in engine:  # --full-batch 0 leaves the check out
        info["full_batch"] = {
            "batch_size": engine["full_batch_size"],
            "tokens_per_s": engine["full_batch_tokens_per_s"],
            "flops_fraction": engine["full_batch_tokens_per_s"] * 2 * params / ceiling,
        }
    wf = engine["workload_flops"]
    limit_s = (wf["gemm"] + wf["attention"]) / ceiling
    info["physical_limit"] = {**wf, "seconds": limit_s, "engine_multiple": engine["wall_s"] / limit_s}
    rows.append(
        {
            "name": "physical limit (FLOPs / GEMM peak)",
            "tokens_per_s": engine["output_tokens"] / limit_s,
            "requests_per_s": engine["requests"] / limit_s,
            "ttft_p50_s": None,
            "ttft_p95_s": None,
        }
    )
    if hf is not None:
        same = sum(engine["texts"][k] == hf["texts"].get(k) for k in engine["texts"])
        info["greedy_text_equal_to_hf"] = f"{same}/{len(engine['texts'])}"
        info["hf_sweep_tokens_per_s"] = hf["sweep_tokens_per_s"]
    info["kv_cache_dtype"] = {kvd: agreement(engine, r) for kvd, r in narrow.items()}
    info["weight_dtype"] = {wd: agreement(engine, r) for wd, r in weights.items()}
    if llama is not None:
        lb1 = llama["decode_tokens_per_s"]["1"]
        info["batch1_vs_llamacpp"] = {
            r["name"]: r["decode_tokens_per_s"]["1"] / lb1
            for r in rows
            if r.get("weight_bytes") and r.get("decode_tokens_per_s")
        }
        same = sum(engine["texts"][k] == llama["texts"].get(k) for k in engine["texts"])
        # the same Q4_1 weights; llama.cpp's dot products take 8-bit-quantised activations, ours float32 ones
        info["greedy_text_equal_to_llamacpp"] = (
            f"{same}/{len(engine['texts'])} (same Q4_1 weights; llama.cpp quantises activations to 8 bits)"
        )
    if queue is not None:
        info["queue_vs_engine"] = queue["tokens_per_s"] / engine["tokens_per_s"]
        itemsize = 4 if ns.dtype == "float32" else 2
        budget = params * itemsize / 2**20 + engine["kv_pool_mb"] + 1024  # the pool is sized from memory
        info["worker_rss"] = {"peak_mb": queue["peak_rss_mb"], "budget_mb": budget}
    info.update(side_measurements(ns.skip))
    for r in rows:
        r.pop("texts", None)
        r.pop("token_ids", None)
    info["rows"] = rows

    print()
    print(table(info, rows, hf["tokens_per_s"] if hf else None))
    print_findings(info)
    print_cost(info)
    out = Path(ns.out) if ns.out else ROOT / "benchmarks" / "results" / f"bench-{ns.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
