"""Where the engine's time goes on the standard workload: per-phase step times, then the top torch ops.

    python benchmarks/profile_engine.py --dtype bfloat16            # step breakdown
    python benchmarks/profile_engine.py --dtype bfloat16 --ops 25   # + torch.profiler tables
    python benchmarks/profile_engine.py --dtype float32 --pieces    # + each kernel's share of the run

The breakdown splits wall time into prefill steps (prompt tokens/s), decode steps (by batch size) and
everything outside the model (scheduling, stop rules, detokenising). Use it before and after a change.
--pieces times every call of the model's pieces (linear layers by size, K/V writes, attention, norms,
rotary) over the same run: the C kernels are called through ctypes, which torch.profiler does not see.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# linear.c's KB_ROWS: calls of more rows take its GEMM-blocked path (prompt chunks), the rest its decode path
KB_ROWS = 64


@contextmanager
def timed_pieces(engine: Any) -> Iterator[dict[str, list[float]]]:
    """Every call of the model's pieces in the block, timed: name -> [calls, seconds, FLOPs]. Torch's CPU
    ops and the C kernels return when done, so a call's wall time is its cost. A decode step that
    decode_stack.c runs whole calls none of them (its time is the decode steps' figure)."""
    from worker.models import layers, llama

    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    undo: list[Callable[[], None]] = []

    def wrap(
        owner: Any, attr: str, name: Callable[..., str], flops: Callable[..., float] | None = None
    ) -> None:
        inner, own = getattr(owner, attr), attr in vars(owner)
        # the backend's AttentionBackend is a frozen dataclass: its fields are swapped for the run only
        put = (
            object.__setattr__ if dataclasses.is_dataclass(owner) and not isinstance(owner, type) else setattr
        )

        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = inner(*a, **k)
            piece = acc[name(*a)]
            piece[0] += 1
            piece[1] += time.perf_counter() - t
            piece[2] += flops(*a) if flops else 0.0
            return out

        put(owner, attr, call)
        undo.append(lambda: put(owner, attr, inner) if own else delattr(owner, attr))

    wrap(
        layers.Linear,
        "forward",
        lambda m, x: "linears, prompt-sized" if x.shape[0] > KB_ROWS else "linears, decode-sized",
        lambda m, x: 2.0 * x.shape[0] * m.in_features * m.out_features,
    )
    attn = engine.model_runner.backend.attention
    wrap(attn, "write_kv", lambda *a: "K/V writes into the pool")
    wrap(attn, "paged_prefill_attention", lambda *a: "prompt attention")
    wrap(attn, "paged_decode_attention", lambda *a: "decode attention (layer by layer)")
    wrap(layers.RMSNorm, "forward", lambda *a: "RMSNorm")
    wrap(llama, "apply_rotary", lambda *a: "rotary")
    try:
        yield acc
    finally:
        for u in reversed(undo):
            u()


def print_phases(times: dict[str, list[tuple[int, int, float]]]) -> None:
    """Prompt tokens/s of prefill and mixed steps; decode steps by batch size."""
    pre = times["prefill"]
    if pre:
        pt, ps = sum(x[1] for x in pre), sum(x[2] for x in pre)
        print(f"prefill: {len(pre)} steps, {pt} tokens, {ps:.1f}s, {pt / ps:.0f} tok/s")
    mixed = times["mixed"]
    if mixed:
        mt, ms = sum(x[1] for x in mixed), sum(x[2] for x in mixed)
        print(f"mixed: {len(mixed)} steps, {mt} tokens ({sum(x[0] for x in mixed)} decoded), "
              f"{ms:.1f}s, {mt / ms:.0f} tok/s")  # fmt: skip
    dec = times["decode"]
    if dec:
        ds = sum(x[2] for x in dec)
        print(f"decode: {len(dec)} steps, {sum(x[0] for x in dec)} tokens, {ds:.1f}s")
        buckets: dict[int, list[float]] = defaultdict(list)
        for n, _, t in dec:
            buckets[min(64, 1 << (n - 1).bit_length())].append(t)
        for b in sorted(buckets):
            v = buckets[b]
            print(f"  batch <= {b:3d}: {len(v):4d} steps, median {statistics.median(v) * 1e3:6.1f} ms")


def print_pieces(pieces: dict[str, list[float]]) -> None:
    import torch

    from worker.kernels import native_linear

    peak = native_linear.fma_peak(torch.get_num_threads()) if native_linear.library() else 0.0
    print(f"pieces ({'FMA peak %.0f GFLOP/s' % (peak / 1e9) if peak else 'no C kernels'}):")
    for name, (calls, s, flops) in sorted(pieces.items(), key=lambda kv: -kv[1][1]):
        rate = f", {flops / s / 1e9:.0f} GFLOP/s" if flops else ""
        share = f" = {100 * flops / s / peak:.0f}% of the peak" if flops and peak else ""
        print(f"  {name:<34} {s:7.2f} s  {int(calls):6d} calls{rate}{share}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("-n", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--policy", default="longest_first")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--admission", default="optimistic", choices=["optimistic", "reserve"])
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"])
    p.add_argument(
        "--dequantised",
        action="store_true",
        help="the GGUF's float32 dequantisation, as bench.py's weight rows load it (what --weight-dtype narrows)",
    )
    p.add_argument(
        "--ops", type=int, default=0, help="print the top N ops of one prefill and one decode step"
    )
    p.add_argument("--pieces", action="store_true", help="time each piece of the model over the run")
    ns = p.parse_args()

    from benchmarks.contenders import MODEL
    from benchmarks.workload import generate
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineError, EngineRequest
    from worker.engine_config import EngineConfig
    from worker.models.resolve import hf_checkpoint

    cfg = EngineConfig(
        model=hf_checkpoint(MODEL) if ns.dequantised else MODEL,
        device="cpu",
        dtype=ns.dtype,
        weight_dtype=ns.weight_dtype,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        schedule_policy=ns.policy,
        prefix_cache=not ns.no_prefix_cache,
        admission=ns.admission,
    )
    engine = Engine.load(cfg)
    lines = generate(ns.n, tokenizer=engine.tokenizer)

    def reqs(ls: list[dict[str, Any]]) -> list[EngineRequest]:
        return [
            EngineRequest(
                request_id=ln["id"],
                params=GenerationParams(max_new_tokens=ln["max_new_tokens"], temperature=0),
                messages=ln["messages"],
            )
            for ln in ls
        ]

    engine.generate(reqs(lines[:4]))  # warm-up
    runner = engine.model_runner
    times: dict[str, list[tuple[int, int, float]]] = defaultdict(list)  # phase -> (seqs, tokens, s)
    inner = runner.run

    def timed(batch: Any) -> Any:
        t = time.perf_counter()
        out = inner(batch)
        # tokens computed: one per decoding sequence (all of them in a decode step), plus prompt chunks
        decoding = len(batch.seqs) if batch.phase == "decode" else batch.num_decode
        tokens = decoding + sum(batch.chunks)
        times[batch.phase].append((decoding, tokens, time.perf_counter() - t))
        return out

    runner.run = timed  # type: ignore[method-assign]
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with timed_pieces(engine) if ns.pieces else nullcontext({}) as pieces:
        t0 = time.perf_counter()
        results = engine.generate(reqs(lines))
        wall = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    runner.run = inner  # type: ignore[method-assign]

    out_tokens = sum(r.completion_tokens for r in results)
    model_s = sum(t for v in times.values() for _, _, t in v)
    print(f"{ns.n} requests, {out_tokens} output tokens in {wall:.1f}s = {out_tokens / wall:.1f} tok/s")
    print(f"outside the model: {wall - model_s:.1f}s; peak RSS {_peak_rss_mb():.0f} MB; "
          f"preemptions {engine.stats().preemptions}")  # fmt: skip
    # Pages touched for the first time (the KV pool's fresh blocks above all): each costs a fault, so a cold
    # worker's prompt steps pay for them until its pool is resident. On a VM a fault on memory the guest has
    # not used since it booted also waits for the host to back it, which costs several times more.
    print(f"minor page faults: {faults} ({faults * 4 / 1024:.0f} MB of 4 KB pages)")
    print_phases(times)
    if pieces:
        print_pieces(pieces)

    if ns.ops:
        from torch.profiler import ProfilerActivity, profile

        for r in reqs(lines[:48]):
            engine.add_request(r)
        while engine.stats().waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        print(f"\n== one decode step, {engine.stats().running} sequences")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ns.ops))
        engine.abort_all(EngineError("cancelled", "profiling done"))

        for r in reqs(lines[:16]):
            engine.add_request(r)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        print(f"\n== one prefill step, {engine.stats().prompt_tokens} prompt tokens so far")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ns.ops))
        engine.abort_all(EngineError("cancelled", "profiling done"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
