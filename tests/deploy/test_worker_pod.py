"""A worker as Kubernetes runs it (deploy/k8s): its health probe with Redis down, and a scale-in's SIGTERM
mid-batch, with the grace the manifests configure and the kubelet's SIGKILL after the pod's grace.

Real processes: a Redis of the test's own, workers on a tiny random Llama (tests/worker/test_faults.py
checks the hand-back of requests a short grace cannot finish).
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
import redis

from producer.wire import keys
from tests.deploy.conftest import container, find, render
from tests.deploy.test_manifests import worker_settings
from tests.worker.conftest import (
    Worker,
    assert_consistent,
    hold_mid_batch,
    results_count,
    submit,
    wait_until,
    write_jsonl,
)
from tests.worker.test_faults import long_requests

pytestmark = pytest.mark.slow

# The GPU overlay's pod, on the test's CPU; max_tries 1: a hand-back that counted as a try would fail.
WORKER = ["--max-num-seqs", "4", "--prefetch", "2", "--kv-cache-gb", "0.05", "--repetition-repeats", "0",
          "--max-tries", "1", "--metrics-port", "0"]  # fmt: skip


def metrics_port(w: Worker) -> int:
    """The port the worker chose (--metrics-port 0), from its heartbeat."""
    r = redis.Redis.from_url(w.url)
    try:
        return int(orjson.loads(r.get(keys.worker_heartbeat(w.id)) or b"{}")["metrics_port"])
    finally:
        r.close()


def health(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


def test_the_health_probe_answers_from_the_worker_while_redis_is_down(
    server, workers, tiny_model_dir: Path
) -> None:
    w = workers(server.url, str(tiny_model_dir), *WORKER, name="probe").wait_ready()
    port = metrics_port(w)
    code, body = health(port)
    assert (code, body["status"]) == (200, "ok")
    server.kill()
    try:
        wait_until(lambda: "redis unavailable" in w.full_log(), 30, "the worker to notice Redis is gone")
        # Kubernetes would restart a worker whose liveness probe failed; this one reconnects by itself.
        code, body = health(port)
        assert (code, body["status"]) == (200, "ok") and w.proc.poll() is None
    finally:
        server.start()


def test_a_scaled_in_worker_drains_within_its_pods_grace_and_every_request_is_answered_once(
    server, workers, tiny_model_dir: Path, tmp_path: Path
) -> None:
    objs = render("gpu")
    grace = worker_settings(objs).shutdown_grace_s
    kill_after = find(objs, "Deployment", "batchq-worker")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert "--shutdown-grace-s" in container(find(objs, "Deployment", "batchq-worker"))["args"]
    args = [*WORKER, "--shutdown-grace-s", str(grace)]
    a = workers(server.url, str(tiny_model_dir), *args, name="a").wait_ready()
    a.signal(signal.SIGSTOP)  # until it holds requests of the batch, then the scale-in
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(8, max_new=100)))
    hold_mid_batch(a, server.url, bid, at_least=2)
    t0 = time.monotonic()
    a.signal(signal.SIGTERM)  # the scale-in, delivered as the worker goes on
    a.signal(signal.SIGCONT)
    try:
        code = a.wait(kill_after)
    except subprocess.TimeoutExpired:
        a.signal(signal.SIGKILL)  # the kubelet, terminationGracePeriodSeconds after SIGTERM
        pytest.fail(f"still draining {kill_after}s after SIGTERM: the kubelet would SIGKILL it\n{a.log()}")
    drained = time.monotonic() - t0
    assert code == 0, a.log()
    assert drained < grace, f"drained in {drained:.1f}s, past --shutdown-grace-s {grace}"
    # It finished what it held within the grace: nothing was handed back, and its results are stored.
    log = a.full_log()
    assert "SIGTERM: no new requests" in log and "handing" not in log
    assert 2 <= results_count(server.url, bid) < 8
    # The replacement (another replica, or the next scale-up) answers the rest; each request once.
    workers(server.url, str(tiny_model_dir), *args, name="b").wait_ready()
    wait_until(lambda: results_count(server.url, bid) == 8, 120, "all results")
    results = assert_consistent(server.url, bid, 8)
    assert [x["finish_reason"] for x in results.values()] == ["length"] * 8, results
    assert all(x["usage"]["completion_tokens"] == 100 for x in results.values())
