"""The queue path with the model taken out: what one worker process, and a fleet, carry per request.

    .venv/bin/python benchmarks/queue_bench.py [--workers 1] [--requests 2000] [--batches 1]
        [--kill 0] [--profile] [--latency 50] [--max-num-seqs 256]

Starts its own Redis and N `worker --model stand-in --engine-stand-in` processes (worker/queue/stand_in.py:
every request answered at once, one token), submits the requests (one-token labeling-style lines, unique
per run so the result cache never answers them), and waits for every result. Prints end-to-end
requests/s, worker CPU per request (every worker process's user + system time), Redis commands and Redis
CPU per request over the whole run (INFO commandstats / INFO cpu; workers claim while submit still
enqueues, so submit's part is included), the commands by cost, each worker's share, and the latency of lone requests (submit one, wait for its result; p50 / p99). `--kill K` kills K
workers with SIGKILL a third of the way through and checks every request still ends in exactly one result.
`--profile` runs worker 0 under cProfile and prints its top frames.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
import psutil
from redis.asyncio import Redis

from producer.client import BatchqClient
from producer.wire import keys
from worker.embedded_redis import RedisServer

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "bench"


def worker_cmd(url: str, i: int, args: argparse.Namespace, profile: Path | None) -> list[str]:
    run = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "worker.cli"] if profile else [
        sys.executable, "-m", "worker.cli"]  # fmt: skip
    return [*run, "--model", "stand-in", "--engine-stand-in", "--redis-url", url, "--queue", QUEUE,
            "--worker-id", f"bench-{i}", "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(max(4096, args.max_num_seqs)), "--heartbeat-s", "1",
            "--log-interval-s", "60", "--lease-s", "10", "--poll-delay-s", "0.01"]  # fmt: skip


async def redis_counters(r: Redis) -> tuple[int, float, dict[str, tuple[int, int]]]:
    """(commands served, CPU seconds of the server, {command: (calls, usec)}) so far. Commands that Lua
    scripts call count as commands, and their time counts both for them and for the EVALSHA."""
    stats = await r.info("commandstats")
    per = {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}
    calls = sum(c for name, (c, _) in per.items() if name not in ("evalsha", "eval"))
    cpu = await r.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), per


def top_commands(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], m: int) -> list[str]:
    rows = []
    for name, (c, us) in after.items():
        c0, us0 = before.get(name, (0, 0))
        if c > c0:
            rows.append((us - us0, c - c0, name))
    return [f"| {name} | {c / m:.2f} | {us / m:.1f} |" for us, c, name in sorted(rows, reverse=True)[:12]]


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def lines(run: str, n: int, first: int = 0) -> list[bytes]:
    return [orjson.dumps({"id": f"r{i}", "prompt": f"{run} label item {i}: good or bad?", "max_new_tokens": 1,
                          "temperature": 0}) for i in range(first, first + n)]  # fmt: skip


async def wait_all(client: BatchqClient, batch_ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(batch_ids)
    while pending:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out with {len(pending)} batches unfinished")
        pending = [b for b in pending if (s := await client.status(b)).done < s.total]
        await asyncio.sleep(0.02)


async def exactly_once(r: Redis, batch_ids: list[str], per_batch: list[int]) -> tuple[int, int]:
    """(results stored, requests) over the batches, after checking each batch's counts and results agree."""
    stored = total = 0
    for bid, n in zip(batch_ids, per_batch, strict=True):
        results = await r.hlen(keys.batch_results(bid))
        meta = await r.hgetall(keys.batch_meta(bid))
        done = sum(int(meta.get(f.encode(), 0)) for f in ("completed", "failed", "cancelled"))
        if results != n or done != n:
            raise SystemExit(f"batch {bid}: {results} results, counters say {done}, {n} requests")
        stored, total = stored + results, total + n
    return stored, total


async def latency(client: BatchqClient, run: str, n: int) -> list[float]:
    """Submit lone one-request batches one after another; each one's time from submit to its result."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        rep = await client.submit_lines([lines(run + "-lat", 1, i)[0]], queue=QUEUE)
        while (await client.status(rep.batch_id)).done < 1:
            await asyncio.sleep(0.0005)
        out.append(time.perf_counter() - t0)
    return sorted(out)


def pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))]


class Fleet:
    """Redis and the worker processes of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="queue-bench-"))
        self.server = RedisServer(appendonly=False).start()
        self.prof = self.tmp / "worker0.prof" if args.profile else None
        self.procs = []
        for i in range(args.workers):
            with open(self.tmp / f"worker-{i}.log", "wb") as log:
                cmd = worker_cmd(self.server.url, i, args, self.prof if i == 0 else None)
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))

    async def ready(self, client: BatchqClient, n: int) -> list[psutil.Process]:
        deadline = time.monotonic() + 120
        while len(await client.workers(QUEUE)) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise SystemExit(f"workers did not start; logs in {self.tmp}")
            await asyncio.sleep(0.2)
        return [psutil.Process(p.pid) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.server.close()


async def kill_at_a_third(r: Redis, fleet: Fleet, m: int, k: int) -> int:
    """SIGKILL the last k workers once a third of the requests have their results (batches still being
    submitted are counted as they appear)."""
    while True:
        bids = [b.decode() for b in await r.zrange(keys.BATCHES, 0, -1)]
        done = 0
        for b in bids:
            done += int(await r.hlen(keys.batch_results(b)))
        if done >= m // 3:
            break
        await asyncio.sleep(0.01)
    for p in fleet.procs[-k:]:
        p.send_signal(signal.SIGKILL)
    return k


async def worker_shares(r: Redis, ids: list[str]) -> dict[str, int]:
    shares: dict[str, int] = {}
    for b in ids:
        for raw in (await r.hgetall(keys.batch_results(b))).values():
            w = orjson.loads(raw)["worker"]
            shares[w] = shares.get(w, 0) + 1
    return shares


async def run(args: argparse.Namespace) -> None:
    fleet = Fleet(args)
    r = Redis.from_url(fleet.server.url)
    client = BatchqClient.from_url(fleet.server.url)
    m = args.requests
    try:
        ps = await fleet.ready(client, args.workers)
        run_id = uuid.uuid4().hex[:8]
        per_batch = [m // args.batches + (i < m % args.batches) for i in range(args.batches)]
        c0, wcpu0 = await redis_counters(r), cpu_s(ps)
        killer = asyncio.create_task(kill_at_a_third(r, fleet, m, args.kill)) if args.kill else None
        t0 = time.perf_counter()
        ids, first = [], 0
        for n in per_batch:
            ids.append((await client.submit_lines(lines(run_id, n, first), queue=QUEUE)).batch_id)
            first += n
        t_sub = time.perf_counter()
        c1 = await redis_counters(r)
        killed = await killer if killer is not None else 0
        await wait_all(client, ids, args.timeout)
        t_done = time.perf_counter()
        c2, wcpu2 = await redis_counters(r), cpu_s(ps)
        stored, total = await exactly_once(r, ids, per_batch)
        shares = await worker_shares(r, ids)
        lat = await latency(client, run_id, args.latency) if args.latency and not args.kill else []
    finally:
        await client.close()
        await r.aclose()
        fleet.close()

    print(
        f"# queue_bench: {args.workers} worker(s) x {m} requests in {args.batches} batch(es), stand-in engine"
    )
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    rows = [
        ("end to end (submit start to last result), req/s", f"{m / (t_done - t0):,.0f}"),
        ("workers' drain (submit end to last result), req/s", f"{m / (t_done - t_sub):,.0f}"),
        ("submit, req/s", f"{m / (t_sub - t0):,.0f}"),
        ("worker CPU per request (all workers), ms", f"{1000 * (wcpu2 - wcpu0) / m:.3f}"),
        ("Redis commands per request (submit included)", f"{(c2[0] - c0[0]) / m:.1f}"),
        ("Redis CPU per request (submit included), us", f"{1e6 * (c2[1] - c0[1]) / m:.1f}"),
        ("of which until submit returned, us", f"{1e6 * (c1[1] - c0[1]) / m:.1f}"),
        ("results stored / requests", f"{stored} / {total}"),
    ]
    if lat:
        rows.append(
            (
                "lone request latency p50 / p99, ms",
                f"{1000 * pct(lat, 0.5):.1f} / {1000 * pct(lat, 0.99):.1f}",
            )
        )
    rows += [(f"share of worker {w}", f"{n} ({100 * n / m:.1f}%)") for w, n in sorted(shares.items())]
    if killed:
        rows.append(("killed with SIGKILL at a third of the results", f"{killed} worker(s)"))
    print("| figure | value |\n|---|---:|")
    print("\n".join(f"| {name} | {value} |" for name, value in rows))
    print("\n| Redis command (the whole run) | calls per request | usec per request |\n|---|---:|---:|")
    print("\n".join(top_commands(c0[2], c2[2], m)))
    if fleet.prof is not None and fleet.prof.exists():
        print("\n# worker 0, top frames by own time (cProfile)")
        pstats.Stats(str(fleet.prof)).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--batches", type=int, default=1)
    p.add_argument("--kill", type=int, default=0, help="SIGKILL this many workers at a third of the results")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--latency", type=int, default=50, help="lone requests timed one after another")
    p.add_argument("--profile", action="store_true", help="run worker 0 under cProfile")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
