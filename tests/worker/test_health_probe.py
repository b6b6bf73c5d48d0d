"""The worker's /health on its metrics port (worker/queue/health.py Liveness): what Kubernetes' probes ask.

It answers from the process alone: healthy while the engine and the event loop move, 503 once either has
stood still for stall_s; every other path still serves the metrics. (A live worker's /health, with its
Redis stopped, is checked in tests/deploy/test_scale_in.py.)
"""

from __future__ import annotations

import io
import time
from types import SimpleNamespace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Gauge

from worker.queue.health import Liveness
from worker.queue.metrics import _app


def engine(has_work: bool, idle_s: float) -> Any:
    return SimpleNamespace(
        core=SimpleNamespace(has_work=lambda: has_work), last_progress=time.monotonic() - idle_s
    )


def test_health_is_ok_while_idle_or_progressing_and_503_once_stalled() -> None:
    assert Liveness(engine(has_work=False, idle_s=1e6), stall_s=60).report()[0]  # idle: nothing to do
    assert Liveness(engine(has_work=True, idle_s=1), stall_s=60).report()[0]
    ok, body = Liveness(engine(has_work=True, idle_s=61), stall_s=60).report()
    assert not ok and body["status"] == "engine stalled"
    stuck = Liveness(engine(has_work=False, idle_s=0), stall_s=60)
    stuck.pulse -= 61  # the event loop has not run its pulse for longer than stall_s
    ok, body = stuck.report()
    assert not ok and body["status"] == "event loop stalled" and body["loop_age_s"] >= 61


def call(app: Any, path: str) -> tuple[str, bytes]:
    seen: dict[str, str] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        seen["status"] = status

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "wsgi.input": io.BytesIO()}
    body = b"".join(app(environ, start_response))
    return seen["status"], body


def test_health_beside_the_metrics_on_one_port() -> None:
    registry = CollectorRegistry()
    Gauge("batchq_probe_test", "a series", registry=registry).set(3)
    answers = iter([(True, {"status": "ok"}), (False, {"status": "engine stalled"})])
    app = _app(registry, lambda: next(answers))
    assert call(app, "/health") == ("200 OK", orjson.dumps({"status": "ok"}))
    status, body = call(app, "/health")
    assert status.startswith("503") and orjson.loads(body)["status"] == "engine stalled"
    status, body = call(app, "/metrics")
    assert status == "200 OK" and b"batchq_probe_test 3.0" in body
