"""`producer serve`'s /metrics: pending work per queue, in Prometheus' text format, for an autoscaler.

KEDA (deploy/k8s/base/worker-scaledobject.yaml) scales a queue's workers on batchq_queue_pending: it
is read from Redis at each scrape (producer/client/queue_load.py), so it exists while no worker runs,
from zero workers up. Written by hand: prometheus_client is the worker's dependency, not the producer's.
"""

from __future__ import annotations

from producer.client.queue_load import QueueLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# name, help, the QueueLoad field it reports
GAUGES = (
    ("batchq_queue_pending", "requests queued or running on the queue (producer status: queued + running)",
     "pending"),
    ("batchq_queue_running", "of the pending requests, those a worker has started", "running"),
    ("batchq_queue_batches", "batches with pending requests on the queue", "batches"),
)  # fmt: skip


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(loads: dict[str, QueueLoad]) -> bytes:
    """The gauges of every queue in `loads`, one series per queue (label `queue`, the short name)."""
    lines = []
    for name, help_, field in GAUGES:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        lines += [
            f'{name}{{queue="{_label_value(q)}"}} {getattr(load, field)}' for q, load in sorted(loads.items())
        ]
    return ("\n".join(lines) + "\n").encode()
