"""Fixtures for end-to-end tests: real Redis servers, real worker processes, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from producer.wire import keys
from worker.embedded_redis import RedisServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A Redis of this test's own (AOF, fsync always) that it may kill and restart."""
    with RedisServer(appendonly=True, appendfsync="always") as s:
        yield s


class Worker:
    """A `worker` process (python -m worker.cli) with its log in a file."""

    def __init__(self, url: str, model: str, log_dir: Path, name: str, *args: str) -> None:
        self.log_path = log_dir / f"worker-{name}.log"
        self._log = self.log_path.open("wb")
        self.id = f"test-{name}-{time.monotonic_ns()}"
        cmd = [sys.executable, "-m", "worker.cli", "--model", model, "--redis-url", url, "--worker-id", self.id,
               "--device", "cpu", "--heartbeat-s", "0.5", "--log-interval-s", "2", *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.url = url
        self.model = model

    def wait_ready(self, timeout: float = 180.0) -> Worker:
        r = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"worker exited early:\n{self.log()}"
                try:
                    if r.exists(keys.worker_heartbeat(self.id)):
                        return self
                except redis.ConnectionError:
                    pass
                time.sleep(0.2)
        finally:
            r.close()
        raise AssertionError(f"worker not ready in {timeout}s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        """The log's tail, for assertion messages."""
        return self.full_log()[-4000:]

    def full_log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Any]:
    started: list[Worker] = []

    def start(url: str, model: str, *args: str, name: str | None = None) -> Worker:
        w = Worker(url, model, tmp_path, name or str(len(started)), *args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def batch_state(url: str, batch_id: str) -> dict[str, Any]:
    """Counters, stored results and their token sums, read straight from Redis."""
    r = redis.Redis.from_url(url)
    try:
        meta = {k.decode(): v.decode() for k, v in r.hgetall(keys.batch_meta(batch_id)).items()}
        results = {int(k): orjson.loads(v) for k, v in r.hgetall(keys.batch_results(batch_id)).items()}
    finally:
        r.close()
    return {"meta": meta, "results": results}


def wait_until(pred: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def hold_mid_batch(w: Worker, url: str, batch_id: str, at_least: int = 1, slice_s: float = 0.02) -> None:
    """Let a worker stopped with SIGSTOP run `slice_s` at a time, stopping it after each slice, until it
    holds `at_least` of the batch's requests; it is left stopped. A fast machine answers a test's whole
    batch in well under a second: waiting for requests in flight while the worker runs freely can miss them."""
    r = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            w.signal(signal.SIGCONT)
            time.sleep(slice_s)
            w.signal(signal.SIGSTOP)
            if r.scard(keys.batch_running(batch_id)) >= at_least:
                return
    finally:
        r.close()
    raise AssertionError(f"the worker took fewer than {at_least} of the batch's requests in 60 s of slices")


def results_count(url: str, batch_id: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return int(r.hlen(keys.batch_results(batch_id)))
    except redis.ConnectionError:
        return -1
    finally:
        r.close()


def submit(url: str, path: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--redis-url", url, "--json", *args],
        capture_output=True,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode()
    return str(orjson.loads(out.stdout)["batch_id"])


def assert_consistent(url: str, batch_id: str, total: int) -> dict[int, dict[str, Any]]:
    """Every request has exactly one result, and the counters equal what is stored."""
    st = batch_state(url, batch_id)
    meta, results = st["meta"], st["results"]
    assert sorted(results) == list(range(total))
    done = int(meta.get("completed", 0)) + int(meta.get("failed", 0)) + int(meta.get("cancelled", 0))
    assert done == total == len(results)
    assert int(meta.get("failed", 0)) == sum(r["finish_reason"] == "error" for r in results.values())
    assert int(meta.get("cancelled", 0)) == sum(r["finish_reason"] == "cancelled" for r in results.values())
    assert int(meta.get("prompt_tokens", 0)) == sum(r["usage"]["prompt_tokens"] for r in results.values())
    assert int(meta.get("completion_tokens", 0)) == sum(
        r["usage"]["completion_tokens"] for r in results.values()
    )
    assert int(meta.get("reasoning_tokens", 0)) == sum(
        (r["usage"].get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        for r in results.values()
    )
    return results


def run(coro: Any) -> Any:
    return asyncio.run(coro)
