"""What a decode step spends outside the C kernels, by batch size: whole engine steps profiled, the time in
the decode stack and the LM head's linear.c call against everything else (scheduling, sampling, stop rules,
detokenising, the Python between the kernels).

    .venv/bin/python benchmarks/step_overhead.py [--batches 1,8,16,32] [--context 200]
    BATCHQ_CPU_ISA=avx2 .venv/bin/python benchmarks/step_overhead.py   # the AVX2 kernels

SmolLM2-135M as the engine loads it by default (its GGUF's Q4_1 / Q8_0 weights), float32 compute, greedy,
prompts of --context random tokens; each batch is the best of 3 profiled runs of 10 steps.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time

import torch

from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineError, EngineRequest
from worker.engine_config import EngineConfig
from worker.kernels.native_build import cpu_isa

KERNEL_CALLS = {
    ("native_stack.py", "__call__"),
    ("native_linear.py", "linear_w"),
    ("native_linear.py", "linear"),
}


def measure(engine: Engine, batch: int, context: int) -> tuple[float, float]:
    """(ms a whole step, ms of it in the C kernel calls) at `batch` decoding sequences."""
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(100, 40000, (context,), generator=gen).tolist()
        params = GenerationParams(max_new_tokens=400, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"b{batch}-{i}", params, prompt_token_ids=ids))
    while engine.stats().waiting or not all(s.prefilled for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    best = (math.inf, 0.0)
    for _ in range(3):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(10):
            engine.step()
        prof.disable()
        total = (time.perf_counter() - t) / 10
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        kernels = sum(v[2] for k, v in stats.items() if (k[0].rsplit("/", 1)[-1], k[2]) in KERNEL_CALLS) / 10
        best = min(best, (total, kernels))
    engine.abort_all(EngineError("cancelled", "measured"))
    return best[0] * 1e3, best[1] * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--context", type=int, default=200)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine.load(
        EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_gb=1.5, max_num_seqs=max(batches))
    )
    print(f"kernels built for {cpu_isa()}, {torch.get_num_threads()} threads, contexts of {args.context}")
    print(f"{'batch':>5} | {'step ms':>8} {'C kernels':>9} {'outside':>8} | {'outside a sequence':>18}")
    for b in batches:
        total, kernels = measure(engine, b, args.context)
        print(
            f"{b:>5} | {total:>8.2f} {kernels:>9.2f} {total - kernels:>8.2f} | {(total - kernels) / b:>16.3f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
