"""Paged decode attention: Triton kernel vs the torch reference on one CUDA GPU; on the CPU, the C
kernel (worker/kernels/paged_decode.c) vs the torch path of worker/kernels/torch_attention.py. With
--linear, the CPU linear kernel (worker/kernels/linear.c) against torch and against what the machine allows;
with --moe, the CPU mixture-of-experts kernel (worker/kernels/moe.c) against its weight-streaming bound
(benchmarks/moe_bench.py); with --prefill-attention, the CPU prompt attention kernel
(worker/kernels/prefill_attention.c) against torch's SDPA, float32.

    .venv/bin/python benchmarks/kernel_bench.py [--heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16]
    .venv/bin/python benchmarks/kernel_bench.py --cpu [--heads 9 --kv-heads 3 --head-dim 64 --dtype float32]
    .venv/bin/python benchmarks/kernel_bench.py --linear [--isa native,avx2] [--hidden 576 --inter 1536 ...]
    .venv/bin/python benchmarks/kernel_bench.py --decode-step [--model smollm2-135m --batches 1,8,32]
    .venv/bin/python benchmarks/kernel_bench.py --prefill-attention [--heads 9 --kv-heads 3 --head-dim 64]

--prefill-attention: one prompt's causal attention in one layer at several lengths, q, k and v views of one
fused QKV output as the model hands them over; prefill_attention.c and torch's SDPA (its CPU flash kernel)
alternating, the median of --passes rounds each, with the FLOP rate (the causal half of 4 q_len^2 D H / 2)
and its share of the machine's float32 FMA peak.

--linear: the model's real linear shapes (default SmolLM2-135M's: fused QKV, o, fused gate/up, down, LM
head), each layer's weights a separate copy (--layers of them, cycled) so they are read from DRAM as in
a decode step. First the machine's bounds, measured in the same run: memory bandwidth (the best of a
512 MB float32 sum on all threads) and the float32 FMA peak of the instruction set the kernels were built
for (independent vector FMAs on all threads, linear.c's batchq_fma_probe), with the share of it that a
prompt-sized GEMM reaches (linear.c on 1024 x 2048 x 2048; torch's 2048^3 matmul). Then per shape, at
rows M: torch (F.linear on nn.Linear's [out, in] weight, and x @ W[in, out]), linear.c in float32,
bfloat16 and int8, and the bound: the longer of streaming the weight once and its FLOPs at the peak.
Last, one decode step's linears summed over the model at each M, with linear.c's share of the bound.
Times are the best of --passes passes (the least disturbed by other work on the machine).
`--isa native,avx2` runs it once per instruction set the kernels are built for (BATCHQ_CPU_ISA): on an
AVX-512 machine, the AVX2 path that AVX2-only CPUs run, beside the native one.

GPU: for each (batch, context) it checks the kernel against the reference, then times both with
triton.testing.do_bench and prints one table: milliseconds, the speed-up, and the kernel's KV-read
bandwidth (bytes of K and V in the contexts / time), to compare with the GPU's HBM bandwidth.
Without a GPU it runs the CPU comparison.

--decode-step: whole decode steps of a real model through the engine's runner (float32, C kernels), with
the decode stack (decode_stack.c) and layer by layer (decode_stack = false): the kernels and the Python
around them, per step.

CPU: a decode step's attention over `--layers` layers' caches (so reads come from DRAM, as in the
model), sequences of random length 100-850 in shuffled blocks; best of 4 passes, per layer.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import moe_bench
import torch

from worker.kernels.native_build import cpu_isa

# batch x context: big batches fill the GPU with (sequence, kv head) programs; small ones need split-K.
SHAPES = [(1, 2048), (1, 16384), (4, 8192), (16, 4096), (64, 2048), (128, 1024), (256, 512)]


def make_inputs(
    batch: int, context: int, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> q [batch, heads, dim], k/v cache [blocks, block_size, kv_heads, dim], block tables, context lens
    dtype = getattr(torch, args.dtype)
    per_seq = math.ceil(context / args.block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    # Shuffled physical blocks, as a block manager hands them out after some churn.
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, block_tables, context_lens


def cpu_decode(args: argparse.Namespace) -> int:
    from worker.kernels import native_attention, reference
    from worker.kernels.torch_attention import TorchAttention

    dtype = getattr(torch, args.dtype)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import machine

    m = machine()
    print(f"hardware: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; kernels built for: {cpu_isa()}")
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"decode: heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, "
        f"block size {args.block_size}, {args.dtype}, {args.layers} layers' caches\n"
    )
    if native_attention.library() is None:
        print("kernel_bench: the C kernel is not available here (see the warning above)")
        return 1
    print(f"{'batch':>5} {'tokens':>7} | {'torch ms':>8} {'C ms':>6} {'speed-up':>8} | {'C KV GB/s':>9}")
    gen = torch.Generator().manual_seed(0)
    scale = 1 / math.sqrt(args.head_dim)
    for batch in (8, 32, 64):
        lens = torch.randint(100, 851, (batch,), generator=gen)
        per_seq = (lens + args.block_size - 1) // args.block_size
        num_blocks = int(per_seq.sum())
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        tables = torch.zeros(batch, int(per_seq.max()), dtype=torch.int32)
        for i, start in enumerate((per_seq.cumsum(0) - per_seq).tolist()):
            tables[i, : per_seq[i]] = order[start : start + int(per_seq[i])]
        shape = (args.kv_heads, num_blocks, args.block_size, args.head_dim)
        caches = [
            (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
            for _ in range(args.layers)
        ]
        q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(dtype)
        lens32 = lens.to(torch.int32)
        want = reference.paged_decode_attention(
            q, caches[0][0].permute(1, 2, 0, 3), caches[0][1].permute(1, 2, 0, 3), tables, lens32, scale
        )
        times = {}
        for name, attn in (("torch", TorchAttention(native=False)), ("C", TorchAttention(native=True))):
            got = attn.paged_decode_attention(q, *caches[0], tables, lens32, scale)
            err = (got.float() - want.float()).abs().max().item()
            if err > 5e-2:
                print(f"{batch:>5}: the {name} path disagrees with the reference: max abs error {err:.3g}")
                return 1
            best = math.inf
            for _ in range(4):
                t = time.perf_counter()
                for k, v in caches:
                    attn.paged_decode_attention(q, k, v, tables, lens32, scale)
                best = min(best, (time.perf_counter() - t) / args.layers)
            times[name] = best * 1e3
        kv_bytes = 2 * int(lens.sum()) * args.kv_heads * args.head_dim * caches[0][0].element_size()
        print(
            f"{batch:>5} {int(lens.sum()):>7} | {times['torch']:>8.2f} {times['C']:>6.2f} "
            f"{times['torch'] / times['C']:>7.1f}x | {kv_bytes / times['C'] / 1e6:>9.1f}"
        )
    return 0


def _best_ms(fn: Callable[[], object], passes: int) -> float:
    fn()
    best = math.inf
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _linear_pass(kind: str, x: torch.Tensor, layers: list[tuple[torch.Tensor, ...]], tuning: Any) -> None:
    """One pass of `kind` over the layers' weights; linear.c's under `tuning` (a LinearTuning)."""
    from worker.kernels import native_linear

    for w, wt, packed, bf16, int8, int8_scale, wb in layers:
        if kind == "torch F.linear":
            torch.nn.functional.linear(x, w)
        elif kind == "torch x@W[in,out]":
            torch.mm(x, wt)
        elif kind == "C float32":
            native_linear.linear(x, packed, None, None, w.shape[0], tuning)
        elif kind == "C bfloat16":
            native_linear.linear(x, bf16, None, None, w.shape[0], tuning)
        elif kind == "C bf16 products":
            native_linear.linear_w(x, bf16, w.shape[0], bf16_dot=True, tuning=tuning)
        elif kind == "oneDNN bf16":  # what batch_invariant = false runs for bf16 prompt steps
            torch.nn.functional.linear(x.bfloat16(), wb).float()
        else:
            native_linear.linear(x, int8, int8_scale, None, w.shape[0], tuning)


def machine_bounds(tuning: Any, passes: int = 20) -> tuple[float, float, float, float]:
    """(memory bandwidth in bytes/s; float32 FLOP/s of: the FMA peak of the ISA linear.c was built for,
    MKL's 2048^3 matmul, linear.c's 1024 x 2048 x 2048 GEMM under `tuning`), measured here."""
    from worker.kernels import native_linear

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import gemm_ceiling, memory_bandwidth

    bandwidth = memory_bandwidth(passes)
    fma = native_linear.fma_peak(torch.get_num_threads())
    x, w = torch.randn(1024, 2048), torch.randn(2048, 2048)
    packed = native_linear.pack(w)
    ms = _best_ms(lambda: native_linear.linear(x, packed, None, None, 2048, tuning), 5)
    ours = 2 * 1024 * 2048 * 2048 / (ms / 1e3)
    return bandwidth, fma, gemm_ceiling("float32"), ours


def cpu_linear(args: argparse.Namespace) -> int:
    from worker.kernels import native_linear
    from worker.kernels.linear_methods import PackedLinear
    from worker.models.layers import Linear

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import machine

    if native_linear.library() is None:
        print("kernel_bench: the C linear kernel is not available here (see the warning above)")
        return 1
    from worker.platform.probes import kept_linear_tuning

    tuning = kept_linear_tuning()  # the machine's prefetch hint and tiling, as a worker runs them
    m = machine()
    print(f"hardware: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; kernels built for: {cpu_isa()}")
    print(f"command: {' '.join(sys.argv)}")
    hint = "prefetcht0" if tuning.prefetch_t0 else "prefetchnta"
    far = ", and far ahead into L2 in decode steps" if tuning.far_prefetch else ""
    print(f"weights prefetched with {hint}{far} (this machine's measured choices)")
    if "wide_rows" in native_linear.tunable():
        print(
            f"whole-panel tiles at 1-{tuning.wide_rows} rows"
            if tuning.wide_rows
            else "half-panel tiles at every row count (this machine's measured choice)"
        )
    if tuning.pace_rows:
        print(f"steps of fewer than {tuning.pace_rows} rows paced by tiles of that many (measured choice)")
    # The bounds are measured before the kernels' rows and again after, and the best of each counts, as the
    # best of the kernels' passes does: on a shared host a slow minute at the start would otherwise set the
    # bounds low and flatter every ratio.
    before = machine_bounds(tuning)
    qkv = (args.heads + 2 * args.kv_heads) * args.head_dim
    shapes = [  # (name, K = in, N = out, copies per step)
        ("qkv", args.hidden, qkv, args.model_layers),
        ("o", args.heads * args.head_dim, args.hidden, args.model_layers),
        ("gate_up", args.hidden, 2 * args.inter, args.model_layers),
        ("down", args.inter, args.hidden, args.model_layers),
        ("lm_head", args.hidden, args.vocab, 1),
    ]
    rows = [int(r) for r in args.rows.split(",")]
    kinds = ["torch F.linear", "torch x@W[in,out]", "C float32", "C bfloat16", "C int8"]
    # bfloat16 products (x rounded too): the batch-invariant bfloat16 engine's linears where AVX-512 BF16
    # exists, against oneDNN's bf16 GEMM on the same operands
    dot = native_linear.has_bf16dot()
    if dot:
        kinds += ["C bf16 products", "oneDNN bf16"]
    step: dict[int, dict[str, float]] = {r: dict.fromkeys([*kinds, "bound"], 0.0) for r in rows}
    gen = torch.Generator().manual_seed(0)
    timed: list[tuple[str, int, int, int, int, dict[str, float]]] = []  # name, K, N, copies a step, M, ms
    for name, k, n, per_step in shapes:
        copies = 1 if name == "lm_head" else min(args.layers, per_step)
        layers = []
        for _ in range(copies):
            w = torch.randn(n, k, generator=gen) / k**0.5
            narrow = []
            for dtype in (torch.bfloat16, torch.int8):
                lin = Linear(k, n, bias=False)
                lin.load(w)
                lin.quantize(dtype)
                lin.use_method(PackedLinear(bf16_gemm_rows=0))  # packed for linear.c
                narrow.append(lin)
            bf16, int8 = narrow
            layers.append(
                (
                    w,
                    w.t().contiguous(),
                    native_linear.pack(w),
                    bf16.weight,
                    int8.weight,
                    int8.scale,
                    w.bfloat16(),
                )
            )
        for r in rows:
            x = torch.randn(r, k, generator=gen)
            fns = {kind: functools.partial(_linear_pass, kind, x, layers, tuning) for kind in kinds}
            timed.append(
                (
                    name,
                    k,
                    n,
                    per_step,
                    r,
                    {kind: _best_ms(fn, args.passes) / copies for kind, fn in fns.items()},
                )
            )
        del layers
    after = machine_bounds(tuning)
    bandwidth, peak, mkl, ours = (max(pair) for pair in zip(before, after, strict=True))
    print(
        f"bounds: memory {bandwidth / 1e9:.1f} GB/s (512 MB sum); float32 FMA peak {peak / 1e9:.0f} GFLOP/s "
        f"({cpu_isa()} vectors, {m['threads']} threads); the better of a measurement before the rows below "
        f"({before[0] / 1e9:.1f} GB/s, {before[1] / 1e9:.0f} GFLOP/s) and one after them\n"
        f"prompt-sized GEMM: linear.c 1024x2048x2048 {ours / 1e9:.0f} GFLOP/s = {100 * ours / peak:.0f}% of the "
        f"FMA peak; torch's 2048^3 matmul {mkl / 1e9:.0f} GFLOP/s = {100 * mkl / peak:.0f}%\n"
    )
    print(
        f"{'shape':>8} {'K x N':>12} {'M':>4} | {'F.linear':>8} {'x@W':>7} | {'C f32':>7} {'GB/s':>5} "
        f"{'GFLOP/s':>7} {'% bound':>7} | {'C bf16':>7} {'C int8':>7} | {'bound':>6}"
        + (f" | {'bf16 dot':>8} {'oneDNN':>7}" if dot else "")
        + "  (ms per call)"
    )
    for name, k, n, per_step, r, ms in timed:
        flops = 2 * r * k * n
        bound = max(k * n * 4 / bandwidth, flops / peak) * 1e3
        for kind in kinds:
            step[r][kind] += ms[kind] * per_step
        step[r]["bound"] += bound * per_step
        c = ms["C float32"]
        print(
            f"{name:>8} {f'{k}x{n}':>12} {r:>4} | {ms['torch F.linear']:>8.3f} {ms['torch x@W[in,out]']:>7.3f} "
            f"| {c:>7.3f} {k * n * 4 / c / 1e6:>5.1f} {flops / c / 1e6:>7.1f} {100 * bound / c:>6.0f}% "
            f"| {ms['C bfloat16']:>7.3f} {ms['C int8']:>7.3f} | {bound:>6.3f}"
            + (f" | {ms['C bf16 products']:>8.3f} {ms['oneDNN bf16']:>7.3f}" if dot else "")
        )
    print(f"\none decode step's linears ({args.model_layers} layers + LM head), ms:")
    print(
        f"{'M':>4} | {'F.linear':>8} {'x@W':>7} | {'C f32':>7} {'speed-up':>8} {'% bound':>7} | "
        f"{'C bf16':>7} {'C int8':>7} | {'bound f32':>9}"
        + (f" | {'bf16 dot':>8} {'oneDNN':>7}" if dot else "")
    )
    for r in rows:
        t = step[r]
        best_torch = min(t["torch F.linear"], t["torch x@W[in,out]"])
        print(
            f"{r:>4} | {t['torch F.linear']:>8.1f} {t['torch x@W[in,out]']:>7.1f} | {t['C float32']:>7.1f} "
            f"{best_torch / t['C float32']:>7.1f}x {100 * t['bound'] / t['C float32']:>6.0f}% | "
            f"{t['C bfloat16']:>7.1f} {t['C int8']:>7.1f} | {t['bound']:>9.1f}"
            + (f" | {t['C bf16 products']:>8.1f} {t['oneDNN bf16']:>7.1f}" if dot else "")
        )
    if args.json:  # what `make bench` reports per instruction set
        summary = {
            "isa": cpu_isa(),
            "bandwidth_gb_s": bandwidth / 1e9,
            "fma_peak_gflops": peak / 1e9,
            "prompt_gemm_share_of_fma_peak": ours / peak,
            "decode_rows": {str(r): {"ms": step[r]["C float32"], "bound_ms": step[r]["bound"]} for r in rows},
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def decode_step_ms(engine: Any, batch: int, passes: int) -> float:
    """One decode step of `batch` sequences (prompts of 100-300 tokens) through the engine's runner: ms, the
    best of `passes` passes of 10 steps (each step rewrites the same slots)."""
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineError, EngineRequest

    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(100, 40000, (int(torch.randint(100, 300, (1,), generator=gen)),), generator=gen)
        params = GenerationParams(max_new_tokens=200, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"step{batch}-{i}", params, prompt_token_ids=ids.tolist()))
    while engine.stats().waiting or not all(s.prefilled for s in engine.scheduler.running):
        engine.step()
    step = engine.scheduler.schedule()
    assert step is not None and step.phase == "decode" and len(step.seqs) == batch, "the batch did not fit"
    runner = engine.model_runner
    runner.compute_logits(step)
    best = math.inf
    for _ in range(passes):
        t = time.perf_counter()
        for _ in range(10):
            runner.compute_logits(step)
        best = min(best, (time.perf_counter() - t) / 10)
    engine.abort_all(EngineError("cancelled", "measured"))
    return best * 1e3


def cpu_decode_step(args: argparse.Namespace) -> int:
    """Whole decode steps of a real model (float32, the C kernels), through the decode stack and layer by
    layer: what the per-step Python around the kernels costs."""
    from worker.engine.engine import Engine
    from worker.engine_config import EngineConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import machine

    m = machine()
    print(f"hardware: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; kernels built for: {cpu_isa()}")
    print(f"command: {' '.join(sys.argv)}")
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[bool, list[float]] = {}
    for stack in (True, False):
        cfg = EngineConfig(model=args.model, dtype="float32", kv_cache_gb=1.5, decode_stack=stack)
        engine = Engine.load(cfg)
        times[stack] = [decode_step_ms(engine, b, args.passes) for b in batches]
    print(f"\n{args.model}, float32, one decode step (ms, best of {args.passes} x 10 steps):")
    print(f"{'batch':>5} | {'stack':>7} {'layers':>7} | {'stack speed-up':>14}")
    for b, s, layered in zip(batches, times[True], times[False], strict=True):
        print(f"{b:>5} | {s:>7.2f} {layered:>7.2f} | {layered / s:>13.2f}x")
    return 0


def cpu_prefill_attention(args: argparse.Namespace) -> int:
    import statistics

    import torch.nn.functional as F

    from worker.kernels import native_attention, native_linear

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import machine

    if native_attention.library() is None or native_linear.library() is None:
        print("kernel_bench: the C kernels are not available here (see the warning above)")
        return 1
    m = machine()
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    peak = native_linear.fma_peak(torch.get_num_threads())
    print(f"hardware: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; kernels built for: {cpu_isa()}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"heads {h} over {kvh} kv heads, head dim {d}, float32; FMA peak {peak / 1e9:.0f} GFLOP/s\n")
    print(
        f"{'tokens':>6} | {'SDPA ms':>8} {'GFLOP/s':>7} | {'C ms':>7} {'GFLOP/s':>7} {'% peak':>6} | {'speed-up':>8}"
    )
    gen = torch.Generator().manual_seed(0)
    for n in (64, 188, 600, 1200, 2400):
        qkv = torch.randn(n, (h + 2 * kvh) * d, generator=gen)
        q = qkv[:, : h * d].view(n, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d).transpose(0, 1)
        v = qkv[:, (h + kvh) * d :].view(n, kvh, d).transpose(0, 1)
        runs: dict[str, Callable[[], object]] = {
            "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=d**-0.5, enable_gqa=h != kvh
            ),
            "c": lambda q=q, k=k, v=v: native_attention.prefill(q, k, v, 0, d**-0.5),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for fn in runs.values():
            fn()
        for _ in range(args.passes):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        sdpa, c = (statistics.median(times[name]) for name in ("sdpa", "c"))
        flops = 4 * n * n / 2 * d * h
        print(
            f"{n:>6} | {sdpa * 1e3:>8.2f} {flops / sdpa / 1e9:>7.1f} | {c * 1e3:>7.2f} {flops / c / 1e9:>7.1f} "
            f"{100 * flops / c / peak:>5.0f}% | {sdpa / c:>7.2f}x"
        )
    return 0


def main() -> int:
    from worker.platform.cpu_settings import cap_libraries

    cap_libraries()  # BATCHQ_CPU_ISA=avx2: torch's columns as an AVX2-only machine's, before any matmul
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--linear", action="store_true", help="the CPU linear kernel (linear.c)")
    moe_bench.add_arguments(parser)
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="whole CPU decode steps of --model: the stack vs layer by layer",
    )
    parser.add_argument(
        "--prefill-attention", action="store_true", help="CPU prompt attention: prefill_attention.c vs SDPA"
    )
    parser.add_argument("--model", default="smollm2-135m", help="--decode-step: the model")
    parser.add_argument("--batches", default="1,8,32", help="--decode-step: sequences per step")
    parser.add_argument("--hidden", type=int, default=576, help="--linear: the model's shapes")
    parser.add_argument("--inter", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--model-layers", type=int, default=30)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="--linear: rows M of x")
    parser.add_argument(
        "--passes",
        type=int,
        default=5,
        help="--linear: timed passes (the best counts); --prefill-attention: rounds (the median counts)",
    )
    parser.add_argument("--cpu", action="store_true", help="the CPU kernels, even where a GPU exists")
    parser.add_argument("--layers", type=int, default=30, help="CPU: layers' caches cycled through")
    parser.add_argument("--heads", type=int, help="default: 32 (GPU), 9 (--linear, SmolLM2-135M's)")
    parser.add_argument("--kv-heads", type=int, help="default: 8 (GPU), 3 (--linear)")
    parser.add_argument("--head-dim", type=int, help="default: 128 (GPU), 64 (--linear)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", help="--linear: also write the bounds and the step summary to this file")
    parser.add_argument(
        "--isa",
        help="--linear / --decode-step: kernels built for these instruction sets, one run each "
        "(e.g. native,avx2: BATCHQ_CPU_ISA; default: $BATCHQ_CPU_ISA or native)",
    )
    args = parser.parse_args()
    if args.isa:  # each ISA in a fresh process: a process loads one build of the kernels
        argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--isa" and sys.argv[i] != "--isa"]
        argv = [a for a in argv if not a.startswith("--isa=")]
        for isa in args.isa.split(","):
            env = {**os.environ, "BATCHQ_CPU_ISA": isa}
            rc = subprocess.run([sys.executable, __file__, *argv], env=env, check=False).returncode
            if rc:
                return rc
            print()
        return 0
    if args.decode_step:
        return cpu_decode_step(args)
    if args.moe:
        return moe_bench.run(args)
    if args.linear or args.prefill_attention:
        args.heads, args.kv_heads, args.head_dim = args.heads or 9, args.kv_heads or 3, args.head_dim or 64
        return cpu_prefill_attention(args) if args.prefill_attention else cpu_linear(args)
    args.heads, args.kv_heads, args.head_dim = args.heads or 32, args.kv_heads or 8, args.head_dim or 128
    if args.cpu or not torch.cuda.is_available():
        return cpu_decode(args)

    import triton.testing

    from worker.kernels import reference, triton_attention

    device = torch.device("cuda")
    print(f"hardware: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"decode: heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, "
        f"block size {args.block_size}, {args.dtype}\n"
    )
    print(
        f"{'batch':>5} {'context':>7} | {'reference ms':>12} {'triton ms':>9} {'speed-up':>8} | {'KV GB/s':>7}"
    )
    scale = 1 / math.sqrt(args.head_dim)
    for batch, context in SHAPES:
        inputs = make_inputs(batch, context, args, device)
        want = reference.paged_decode_attention(*inputs, scale)
        got = triton_attention.paged_decode_attention(*inputs, scale)
        err = (got.float() - want.float()).abs().max().item()
        if err > 5e-2:
            print(f"{batch:>5} {context:>7} | kernel disagrees with the reference: max abs error {err:.3g}")
            return 1
        ref_ms = triton.testing.do_bench(functools.partial(reference.paged_decode_attention, *inputs, scale))
        tri_ms = triton.testing.do_bench(
            functools.partial(triton_attention.paged_decode_attention, *inputs, scale)
        )
        kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * inputs[1].element_size()
        print(
            f"{batch:>5} {context:>7} | {ref_ms:>12.3f} {tri_ms:>9.3f} {ref_ms / tri_ms:>7.1f}x | "
            f"{kv_bytes / tri_ms / 1e6:>7.0f}"
        )
        del inputs, want, got
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
