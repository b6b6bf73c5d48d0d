"""The figure KEDA scales workers on: `producer serve`'s /metrics, read before, during and after a batch,
equals `producer status`'s queued + running, and exists while no worker runs.

Real processes throughout: a Redis, `producer serve`, `producer submit` and `producer status`, and a
worker on a tiny random Llama, frozen with SIGSTOP mid-batch so that both readings see one moment.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from producer.wire import keys
from tests.producer.test_server import ApiServer
from tests.worker.conftest import ROOT, hold_mid_batch, results_count, submit, wait_until, write_jsonl
from tests.worker.test_faults import long_requests

pytestmark = pytest.mark.slow

# The default lease (30 s) outlasts the freeze: no request is taken over while the worker is stopped.
WORKER = ["--max-num-seqs", "4", "--prefetch", "2", "--kv-cache-gb", "0.05", "--repetition-repeats", "0"]


def scrape(port: int) -> dict[str, dict[str, float]]:
    """/metrics as {series: {queue: value}}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    families = text_string_to_metric_families(text)
    return {f.name: {s.labels["queue"]: s.value for s in f.samples} for f in families}


def status(url: str, batch_id: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "producer.cli", "status", batch_id, "--json", "--redis-url", url],
                         capture_output=True, cwd=ROOT, check=True, timeout=60)  # fmt: skip
    return dict(orjson.loads(out.stdout))


def test_pending_equals_producer_status_before_during_and_after_a_batch(
    server, workers, tiny_model_dir: Path, tmp_path: Path
) -> None:
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("sk-test-deploy-pending\n")
    api = ApiServer(server.url, keys_file, tmp_path, "pending", "--metrics-queue", "idle").start()
    try:
        api.wait_ready()
        # Before: an empty Redis, no worker: the series exist, at zero.
        assert scrape(api.port)["batchq_queue_pending"] == {"default": 0, "idle": 0}
        # A worker ready and frozen before the batch comes: it claims nothing until it is let run.
        w = workers(server.url, str(tiny_model_dir), *WORKER, name="pending").wait_ready()
        w.signal(signal.SIGSTOP)
        bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(10, max_new=120)))
        s, m = status(server.url, bid), scrape(api.port)
        assert m["batchq_queue_pending"]["default"] == s["queued"] + s["running"] == 10
        assert m["batchq_queue_running"]["default"] == 0 and m["batchq_queue_batches"]["default"] == 1
        # During: the worker let run until it holds requests, then frozen, so that both readings see one moment.
        try:
            hold_mid_batch(w, server.url, bid)
            s, m = status(server.url, bid), scrape(api.port)
            r = redis.Redis.from_url(server.url)
            in_queue = int(r.zcard(keys.DEFAULT_QUEUE))
            r.close()
        finally:
            w.signal(signal.SIGCONT)
        assert s["running"] >= 1 and s["queued"] + s["running"] == 10 - s["completed"] - s["failed"]
        assert m["batchq_queue_pending"]["default"] == s["queued"] + s["running"]
        assert m["batchq_queue_running"]["default"] == s["running"]
        # A claimed job stays in the queue's sorted set until it ends (leased, moved past now): the
        # worker's batchq_queue_depth counts the same requests.
        assert in_queue == s["queued"] + s["running"]
        # After: every request answered, nothing pending, and the idle queue still reported.
        wait_until(lambda: results_count(server.url, bid) == 10, 120, "all results")
        s, m = status(server.url, bid), scrape(api.port)
        assert s["queued"] + s["running"] == 0 and s["completed"] == 10
        assert m["batchq_queue_pending"] == {"default": 0, "idle": 0}
        assert m["batchq_queue_batches"]["default"] == 0
    finally:
        api.kill()
