"""Decode rate alone and beside a co-tenant that keeps one core busy: how a CPU worker shares its machine.

    .venv/bin/python benchmarks/cotenant_bench.py [--model smollm2-135m] [--batch 1] [--seconds 8]

Every CPU decode step is many OpenMP fork/joins. A worker that runs as many threads as the machine has
cores, beside another process busy on one of them, waits at every join for the thread that shares the
busy core. Each contender below runs in a fresh process (libgomp reads its environment once, when torch
loads it), decodes `--batch` sequences for `--seconds` with the real model in float32, alone and then with
a busy-loop process beside it, and reports tokens/s and the shared/alone ratio.

Contenders: batchq's default (threads sized to the CPU budget, then to the cores other processes leave
free: worker/platform/threads.py CpuShare), the budget's thread count fixed (`num_threads`, what a
worker ran before), and one thread fixed. The co-tenant runs for 3 s before the timed steps, the time
the default takes to notice it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = "while True:\n    pass\n"


def child(args: argparse.Namespace) -> int:
    """One contender: load, warm up, then decode for --seconds; prints one JSON line."""
    import torch

    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineError, EngineRequest
    from worker.engine_config import EngineConfig

    cfg = EngineConfig(
        model=args.model, dtype="float32", kv_cache_gb=1.0, num_threads=args.threads, repetition_window=0
    )
    engine = Engine.load(cfg)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(100, 40000, (200,), generator=gen).tolist()
        params = GenerationParams(max_new_tokens=4000, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", params, prompt_token_ids=ids))
    deadline = time.monotonic() + 2.0  # prefill and warm-up steps
    while time.monotonic() < deadline:
        engine.step()
    # Ready: the parent starts the co-tenant now and answers with a line when the timed steps begin; until
    # then the engine keeps decoding, as a worker would while a co-tenant arrives.
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        engine.step()
    sys.stdin.readline()
    tokens0, t0 = engine.counters.tokens_generated, time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        engine.step()
    tokens, elapsed = engine.counters.tokens_generated - tokens0, time.monotonic() - t0
    engine.abort_all(EngineError("cancelled", "measured"))
    print(json.dumps({"tok_s": tokens / elapsed, "threads": torch.get_num_threads()}), flush=True)
    return 0


def run_contender(args: argparse.Namespace, threads: int | None, busy: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch)]
    cmd += ["--seconds", str(args.seconds)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    while proc.stdout.readline().strip() != "ready":
        if proc.poll() is not None:
            raise SystemExit(f"contender {cmd} exited {proc.returncode}")
    hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        time.sleep(3.0 if busy else 0)  # the busy loop runs before the timed steps
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        proc.wait(timeout=60)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return dict(json.loads(line))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed decode per measurement")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench import machine

    from worker.platform.threads import cpu_budget

    m = machine()
    budget = cpu_budget()
    print(f"hardware: {m['cpu']}, {m['cores']} CPUs, CPU budget {budget}, torch {m['torch']}")
    print(f"command: {' '.join(sys.argv)}")
    contenders: list[tuple[str, int | None]] = [
        ("batchq default (follows free cores)", None),
        (f"num_threads = {budget} (fixed)", budget),
        ("num_threads = 1 (fixed)", 1),
    ]
    print(f"\n{args.model}, float32, batch {args.batch}, decode tokens/s over {args.seconds:g} s:")
    print(f"{'contender':<36} {'threads':>7} | {'alone':>7} {'co-tenant':>9} | {'shared/alone':>12}")
    for name, threads in contenders:
        alone = run_contender(args, threads, busy=False)
        shared = run_contender(args, threads, busy=True)
        ratio = shared["tok_s"] / alone["tok_s"]
        print(
            f"{name:<36} {alone['threads']:>3}/{shared['threads']:<3} | {alone['tok_s']:>7.1f} {shared['tok_s']:>9.1f} | "
            f"{100 * ratio:>11.0f}%",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
