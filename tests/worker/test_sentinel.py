"""Redis high availability: a primary, a replica and three sentinels (real redis-server processes), a real
worker and the producer on a redis+sentinel:// URL; the primary is SIGKILLed mid-batch, the sentinels
promote the replica, and the batch completes on it with every result stored exactly once."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from producer.wire import keys
from tests.worker.conftest import ROOT, Worker, assert_consistent, results_count, wait_until, write_jsonl
from worker.embedded_redis import RedisServer, free_port, redis_server_binary

pytestmark = pytest.mark.slow

MASTER = "mymaster"


class Sentinel:
    """`redis-server sentinel.conf --sentinel`, watching MASTER with a 1 s down-after."""

    def __init__(self, directory: Path, primary_port: int) -> None:
        self.port = free_port()
        conf = directory / f"sentinel-{self.port}.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(port=self.port, socket_timeout=2)

    def ready(self) -> bool:
        """Knows the replica and the two other sentinels."""
        try:
            return (
                len(self.client.sentinel_slaves(MASTER)) == 1
                and len(self.client.sentinel_sentinels(MASTER)) == 2
            )
        except redis.RedisError:
            return False

    def master_port(self) -> int:
        return int(self.client.sentinel_get_master_addr_by_name(MASTER)[1])

    def stop(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer, list[Sentinel]]]:
    primary = RedisServer(appendonly=False).start()
    replica = RedisServer(
        appendonly=False, extra_args=("--replicaof", "127.0.0.1", str(primary.port))
    ).start()
    sentinels = [Sentinel(tmp_path, primary.port) for _ in range(3)]
    try:
        r = redis.Redis(port=replica.port)
        wait_until(lambda: r.info("replication")["master_link_status"] == "up", 15, "the replica to sync")
        r.close()
        wait_until(lambda: all(s.ready() for s in sentinels), 20, "the sentinels to find each other")
        yield primary, replica, sentinels
    finally:
        for s in sentinels:
            s.stop()
        replica.close()
        primary.close()


def test_a_batch_completes_exactly_once_across_a_failover(cluster, tiny_model_dir, tmp_path):
    primary, replica, sentinels = cluster
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
    url = f"redis+sentinel://{hosts}/{MASTER}/0"
    args = ["--max-num-seqs", "4", "--repetition-repeats", "0", "--lease-s", "2", "--kv-cache-gb", "0.05",
            "--poll-delay-s", "0.05", "--prefetch", "0"]  # fmt: skip
    worker = Worker(url, str(tiny_model_dir), tmp_path, "sentinel", *args)
    try:
        r = redis.Redis(port=primary.port)

        def ready() -> bool:
            assert worker.proc.poll() is None, worker.log()
            return bool(r.exists(keys.worker_heartbeat(worker.id)))

        wait_until(ready, 120, "the worker to start on the sentinel URL", interval=0.2)
        r.close()
        n = 16
        lines = [{"id": f"r{i}", "prompt": f"failover {i}", "max_new_tokens": 150, "temperature": 0,
                  "ignore_eos": True} for i in range(n)]  # fmt: skip
        cmd = [sys.executable, "-m", "producer.cli", "submit", str(write_jsonl(tmp_path / "in.jsonl", lines)),
               "--redis-url", url, "--json"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, cwd=ROOT, check=False, timeout=60)
        assert out.returncode == 0, out.stderr.decode()
        bid = orjson.loads(out.stdout)["batch_id"]
        wait_until(lambda: results_count(primary.url, bid) >= 2, 60, "the first results")
        assert results_count(primary.url, bid) < n, "the batch finished before the primary could be killed"
        primary.kill()  # SIGKILL mid-batch
        t0 = time.monotonic()
        wait_until(
            lambda: sentinels[0].master_port() == replica.port, 30, "the sentinels to promote the replica"
        )
        wait_until(lambda: results_count(replica.url, bid) == n, 60, "every result on the promoted replica")
        assert time.monotonic() - t0 < 45
        assert_consistent(replica.url, bid, n)
        assert worker.proc.poll() is None, worker.log()
        status = subprocess.run(
            [sys.executable, "-m", "producer.cli", "status", bid, "--json", "--redis-url", url],
            capture_output=True, cwd=ROOT, check=False, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr.decode()
        st = orjson.loads(status.stdout)
        assert (st["state"], st["completed"], st["total"]) == ("completed", n, n)
    finally:
        worker.stop()
