"""Producer enqueue throughput: validate + enqueue N JSONL lines into a local Redis this script starts.

    .venv/bin/python benchmarks/enqueue_bench.py [--lines 100000]

Prints a table: validation (pass 1), enqueue (pass 2, pipelined Lua writing arq's job format), end to end,
and arq's own `enqueue_job` on a sample, measured in the same run, as the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time

import orjson
from arq.connections import ArqRedis
from redis.asyncio import ConnectionPool, Redis

from producer.client.submit import SubmitReport, create_batch, enqueue_spool, validate_to_spool
from producer.wire import keys, serde
from producer.wire.request_params import SamplingParams
from worker.embedded_redis import RedisServer


def make_lines(n: int) -> bytes:
    out = []
    for i in range(n):
        if i % 2:
            line = {
                "id": f"r{i}",
                "prompt": f"Label the sentiment of review {i}: great product",
                "temperature": 0,
            }
        else:
            line = {
                "id": f"r{i}",
                "messages": [{"role": "user", "content": f"Summarise item {i}"}],
                "max_tokens": 32,
            }
        out.append(orjson.dumps(line))
    return b"\n".join(out) + b"\n"


async def bench(n: int, peer_n: int) -> list[tuple[str, int, float]]:
    rows = []
    with RedisServer(appendonly=True, appendfsync="everysec") as srv, tempfile.TemporaryDirectory() as tmp:
        redis = Redis.from_url(srv.url)
        path = os.path.join(tmp, "in.jsonl")
        with open(path, "wb") as f:
            f.write(make_lines(n))
        report = SubmitReport(batch_id="bench")
        queue = keys.queue_name("bench")
        with open(path, "rb") as f, tempfile.TemporaryFile() as spool:
            t0 = time.perf_counter()
            validate_to_spool(f, spool, report, defaults=SamplingParams(max_new_tokens=64), model=None)
            t1 = time.perf_counter()
            fresh = await create_batch(
                redis, report, queue=queue, model=None, defaults=None, result_ttl_s=3600
            )
            await enqueue_spool(redis, spool, report, queue=queue, fresh=fresh)
            t2 = time.perf_counter()
        assert report.enqueued == n and await redis.zcard(queue) == n, "not every line was enqueued"
        rows += [
            ("validate (pass 1)", n, t1 - t0),
            ("enqueue (pass 2)", n, t2 - t1),
            ("submit end to end", n, t2 - t0),
        ]
        await redis.aclose()

        arq = ArqRedis(connection_pool=ConnectionPool.from_url(srv.url), job_serializer=serde.job_serializer)
        t0 = time.perf_counter()
        for i in range(peer_n):
            await arq.enqueue_job(keys.JOB_FUNCTION, {"i": i}, _job_id=f"peer:{i}", _queue_name="peer")
        rows.append(("peer: arq enqueue_job", peer_n, time.perf_counter() - t0))
        await arq.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--peer-lines", type=int, default=5_000)
    args = ap.parse_args()
    rows = asyncio.run(bench(args.lines, args.peer_lines))
    cpu = platform.processor() or platform.machine()
    print(
        f"hardware: {cpu}, {os.cpu_count()} cores, python {platform.python_version()}, local redis-server (AOF)"
    )
    print(f"command:  {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{'stage':<24} {'lines':>9} {'seconds':>9} {'lines/s':>10}")
    for name, n, s in rows:
        print(f"{name:<24} {n:>9} {s:>9.2f} {n / s:>10,.0f}")
    ours = rows[1][1] / rows[1][2]
    peer = rows[3][1] / rows[3][2]
    print(f"enqueue vs arq enqueue_job: {ours / peer:.1f}x")


if __name__ == "__main__":
    main()
