"""A mixture-of-experts layer's experts on the CPU (worker/kernels/moe.c) against their weight-streaming bound
and the torch reference; run by `python benchmarks/kernel_bench.py --moe`.

    .venv/bin/python benchmarks/kernel_bench.py --moe [--moe-hidden 1024 --moe-inter 512 --experts 32 --top-k 4]

Each row M is one step of M tokens, routed top-k over the experts at random (distinct experts per token);
the active experts are those any token picked. The bound is the longer of streaming the active experts'
float32 gate_up and down weights once (their bytes / the memory bandwidth measured in the same run, a
512 MB sum) and their FLOPs at the FMA peak of the instruction set moe.c was built for; beside it, the
same experts' products run one by one through linear.c (the streaming rate moe.c builds on), and the torch
reference (Hugging Face's loop over experts, F.linear). `--moe-layers`
copies of the layer's experts are cycled so that weights come from DRAM, as in a model. Times are the
best of --passes passes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _best_ms(fn: Callable[[], object], passes: int) -> float:
    fn()
    best = math.inf
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moe", action="store_true", help="the CPU mixture-of-experts kernel (moe.c)")
    parser.add_argument("--moe-hidden", type=int, default=1024, help="--moe: hidden size")
    parser.add_argument("--moe-inter", type=int, default=512, help="--moe: each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=32, help="--moe: experts per layer")
    parser.add_argument("--top-k", type=int, default=4, help="--moe: experts per token")
    parser.add_argument("--moe-layers", type=int, default=2, help="--moe: copies of the layer cycled")
    parser.add_argument("--moe-rows", default="1,2,4,8,16", help="--moe: tokens per step")


def run(args: argparse.Namespace) -> int:
    from worker.kernels import native_linear, native_moe
    from worker.kernels.experts import ExpertActivation, Experts
    from worker.kernels.moe_methods import PackedMoE, experts_reference
    from worker.kernels.native_build import cpu_isa

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import machine, memory_bandwidth

    if native_moe.library() is None:
        print("kernel_bench: the C MoE kernel is not available here (see the warning above)")
        return 1
    m = machine()
    print(f"hardware: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; kernels built for: {cpu_isa()}")
    print(f"command: {' '.join(sys.argv)}")
    bandwidth = memory_bandwidth(10)
    peak = native_linear.fma_peak(torch.get_num_threads())
    h, i, e, k = args.moe_hidden, args.moe_inter, args.experts, args.top_k
    expert_bytes = 3 * h * i * 4
    print(
        f"bounds: memory {bandwidth / 1e9:.1f} GB/s, float32 FMA peak {peak / 1e9:.0f} GFLOP/s; experts: {e} "
        f"of hidden {h}, intermediate {i} ({expert_bytes / 1e6:.1f} MB each, float32), top-{k}, "
        f"{args.moe_layers} layer copies\n"
    )
    gen = torch.Generator().manual_seed(0)
    method, act = PackedMoE(), ExpertActivation("silu")
    layers = []
    for _ in range(args.moe_layers):
        gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
        down = torch.randn(e, h, i, generator=gen) / i**0.5
        layers.append((Experts(gate_up, down, act), Experts(method.store(gate_up), method.store(down), act)))
    print(
        f"{'M':>3} {'active':>6} | {'moe.c ms':>8} {'GB/s':>6} | {'bound ms':>8} {'x bound':>7} | "
        f"{'linear.c ms':>11} | {'torch ms':>8} {'speed-up':>8}"
    )
    for r in [int(x) for x in args.moe_rows.split(",")]:
        x = torch.randn(r, h, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(r)])
        w = torch.rand(r, k, generator=gen)
        active = int(ids.unique().numel())

        def c_pass(x: torch.Tensor = x, ids: torch.Tensor = ids, w: torch.Tensor = w) -> None:
            for _, packed in layers:
                method.apply(x, ids, w, packed)

        def torch_pass(x: torch.Tensor = x, ids: torch.Tensor = ids, w: torch.Tensor = w) -> None:
            for experts, _ in layers:
                experts_reference(x, ids, w, experts)

        picked = [(e_, int((ids == e_).sum())) for e_ in ids.unique().tolist()]

        def linears_pass(x: torch.Tensor = x, picked: list[tuple[int, int]] = picked) -> None:
            # the active experts' products one by one through linear.c: the rate moe.c builds on
            for _, packed in layers:
                for e_, rows in picked:
                    native_linear.linear(x[:rows], packed.gate_up[e_], None, None, 2 * i)
                    native_linear.linear(x[:rows, :i].contiguous(), packed.down[e_], None, None, h)

        for experts, packed in layers[:1]:  # the two agree before they are timed
            got = method.apply(x, ids, w, packed)
            torch.testing.assert_close(got, experts_reference(x, ids, w, experts))
        c = _best_ms(c_pass, args.passes) / args.moe_layers
        t = _best_ms(torch_pass, args.passes) / args.moe_layers
        lin = _best_ms(linears_pass, args.passes) / args.moe_layers
        bound = max(active * expert_bytes / bandwidth, 2 * r * k * 3 * h * i / peak) * 1e3
        print(
            f"{r:>3} {active:>6} | {c:>8.3f} {active * expert_bytes / c / 1e6:>6.1f} | {bound:>8.3f} "
            f"{c / bound:>6.2f}x | {lin:>11.3f} | {t:>8.3f} {t / c:>7.1f}x"
        )
    return 0
