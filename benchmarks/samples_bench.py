"""What n > 1 saves: one request for n samples of a long prompt against n requests of that prompt (each with
its sample's seed, so all three rows compute the same tokens), with the prefix cache on and off. The engine
directly, SmolLM2-135M on the CPU (float32), one process.

    python benchmarks/samples_bench.py              # n=8, a ~740-token prompt, 32 new tokens each
    python benchmarks/samples_bench.py --no-cache-row   # also 8 requests without the prefix cache (slow)

Prompt tokens computed come from EngineStats.prefill_tokens (exact); seconds are wall clock of each run,
after an untimed one (a process's first run took ~1.6x longer here).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine.engine import Engine  # noqa: E402
from worker.engine.params import GenerationParams  # noqa: E402
from worker.engine.request import EngineRequest, EngineResult  # noqa: E402
from worker.engine.samples import sample_seed  # noqa: E402
from worker.engine_config import EngineConfig  # noqa: E402

PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(50))


def run(
    model: str, n: int, max_new: int, grouped: bool, prefix_cache: bool
) -> tuple[list[list[int]], int, float]:
    engine = Engine.load(EngineConfig(model=model, device="cpu", dtype="float32", prefix_cache=prefix_cache))
    engine.generate(
        [EngineRequest("warm", GenerationParams(max_new_tokens=2, temperature=0), prompt="warm up")]
    )
    before = engine.stats().prefill_tokens

    def p(**kw: object) -> GenerationParams:
        return GenerationParams(max_new_tokens=max_new, temperature=0.8, ignore_eos=True, **kw)  # type: ignore[arg-type]

    if grouped:
        reqs = [EngineRequest("g", p(seed=7, n=n), prompt=PROMPT)]
    else:
        reqs = [EngineRequest(f"r{i}", p(seed=sample_seed(7, i)), prompt=PROMPT) for i in range(n)]
    t0 = time.monotonic()
    out: list[EngineResult] = engine.generate(reqs)
    seconds = time.monotonic() - t0
    tokens = [s.token_ids for r in out for s in (r.samples or [r])]
    return tokens, engine.stats().prefill_tokens - before, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-cache-row", action="store_true", help="also n requests with the prefix cache off")
    args = ap.parse_args()
    rows = [(f"1 request, n={args.n}", True, True), (f"{args.n} requests, prefix cache", False, True)]
    if args.no_cache_row:
        rows.append((f"{args.n} requests, no prefix cache", False, False))
    print(f"# {platform.processor() or platform.machine()}, {args.model} float32 CPU; command: "
          f"python benchmarks/samples_bench.py {' '.join(sys.argv[1:])}")  # fmt: skip
    print(f"| run | prompt tokens computed | seconds | same tokens as n={args.n} |")
    print("|---|---:|---:|---|")
    run(args.model, args.n, args.max_new_tokens, True, True)  # untimed: a process pays its first run
    ref: list[list[int]] | None = None
    for label, grouped, cache in rows:
        tokens, computed, seconds = run(args.model, args.n, args.max_new_tokens, grouped, cache)
        ref = tokens if ref is None else ref
        print(f"| {label} | {computed} | {seconds:.2f} | {'yes' if tokens == ref else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
