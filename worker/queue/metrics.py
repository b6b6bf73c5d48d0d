"""Prometheus metrics of one worker (prometheus_client), served on `metrics_port` at /metrics, with the
worker's /health (health.Liveness) beside them.

Two sources, and nothing counted twice:
- `WorkerCollector` reads, at scrape time, what is already counted elsewhere: the engine's EngineStats
  (requests running / waiting, KV blocks, token counters, steps and the time in them, preemptions), the
  queue's length (ZCARD of arq's zset: one cheap call per scrape) and the Redis errors the worker caught
  (`REDIS_ERRORS_SEEN`, noted where they are caught).
- `WorkerMetrics.observe` records what only the job sees, once per result this worker stored: the finish
  reason, result-cache answers, and the queue-time, time-to-first-token and latency histograms.

Every batchq_ series carries the labels model, queue (the short name) and worker (the worker id);
prometheus_client's process_* series (CPU seconds, resident memory) come along.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import get_args
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

import orjson
import redis as sync_redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from producer.wire import keys
from producer.wire.results import FinishReason, Result
from producer.wire.workers import queue_label
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.queue.health import VERSION, EngineFacts

LABELS = ("model", "queue", "worker")
# Where the worker catches a Redis error, and what it does then. Every series exists from the start.
REDIS_OPERATIONS = {
    "request": "a job's reads and writes (its result's included), the start-up queue binding: retried until Redis answers",
    "poll": "a queue poll: polled again after a backoff",
    "start": "a job's opening read: the job runs again once its lease lapses",
    "housekeeping": "heartbeat, lease renewal, cancel poll: skipped until the next period",
    "hand_back": "a SIGTERM hand-back: the lease lapses instead",
    "result_cache": "storing an answer in the result cache: skipped",
    "scrape": "the queue depth at a scrape: left out of that scrape",
}
# Seconds. Batch jobs wait in a queue for hours, so the buckets reach a day.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


class RedisErrorTally:
    """Redis errors the worker caught and survived, by operation; and how many of them it retried.

    Process-wide, like prometheus_client's own default registry: one worker runs per process, and the
    places that catch the errors (jobs.retrying, the poll loop, housekeeping) share no object.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors: Tally[str] = Tally(dict.fromkeys(REDIS_OPERATIONS, 0))
        self.retries = 0

    def note(self, operation: str, *, retried: bool = False) -> None:
        assert operation in REDIS_OPERATIONS, operation
        with self._lock:
            self.errors[operation] += 1
            self.retries += retried

    def read(self) -> tuple[dict[str, int], int]:
        with self._lock:
            return dict(self.errors), self.retries


REDIS_ERRORS_SEEN = RedisErrorTally()


class QueueDepth:
    """ZCARD of the worker's queue, read from the scrape's thread on a synchronous client of its own."""

    def __init__(self, url: str, queue_key: str) -> None:
        self.url, self.queue_key = url, queue_key
        self._client: sync_redis.Redis | None = None
        self._lock = threading.Lock()  # scrapes may come in parallel; one client, made once

    def __call__(self) -> int | None:
        try:
            with self._lock:
                if self._client is None:
                    self._client = sync_redis.Redis.from_url(
                        self.url, socket_timeout=1.0, socket_connect_timeout=1.0
                    )
                client = self._client
            depth = client.zcard(self.queue_key)
            assert isinstance(depth, int)  # a synchronous client answers at once
            return depth
        except (sync_redis.RedisError, OSError):
            REDIS_ERRORS_SEEN.note("scrape")
            return None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class WorkerCollector(Collector):
    """Gauges and counters read at scrape time from what the engine, the queue and the worker already count."""

    def __init__(
        self, labels: dict[str, str], engine: AsyncEngine, facts: EngineFacts, depth: Callable[[], int | None]
    ) -> None:
        self.labels, self.engine, self.facts, self.depth = labels, engine, facts, depth
        self.values = [labels[k] for k in LABELS]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.values, value)
        return c

    def _by(self, name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=[*LABELS, label])
        for v, n in values.items():
            c.add_metric([*self.values, v], n)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self.engine.core.stats()
        f = self.facts
        info = InfoMetricFamily(
            "batchq_worker", "the worker: version, device, dtypes, KV pool", labels=LABELS
        )
        info.add_metric(
            self.values,
            {"version": VERSION, "device": f.device, "dtype": f.dtype, "kv_cache_dtype": f.kv_cache_dtype,
             "attention": f.attention, "kv_blocks": str(s.kv_blocks_total), "block_size": str(f.block_size)},
        )  # fmt: skip
        yield info
        yield self._gauge("batchq_requests_running", "requests the engine is computing", s.running)
        yield self._gauge(
            "batchq_requests_waiting", "requests the engine holds but has not admitted yet", s.waiting
        )
        yield self._gauge("batchq_kv_cache_blocks_used", "KV cache blocks held by requests", s.kv_blocks_used)
        yield self._gauge("batchq_kv_cache_blocks", "KV cache blocks in the pool", s.kv_blocks_total)
        yield self._counter(
            "batchq_kv_cache_window_released_blocks",
            "KV blocks the sliding window released as sequences advanced (models windowed in every layer)",
            s.window_released_blocks,
        )
        yield self._gauge(
            "batchq_kv_cache_window_idle_blocks",
            "KV blocks held that only full-attention layers still read (models with windowed and full layers)",
            s.window_idle_blocks,
        )
        yield self._counter(
            "batchq_prompt_tokens",
            "prompt tokens of the requests prefilled (prefix-cache queries)",
            s.prompt_tokens,
        )
        yield self._counter(
            "batchq_prompt_tokens_cached",
            "of those, prompt tokens served from the prefix cache, not computed (prefix-cache hits)",
            s.cached_prompt_tokens,
        )
        yield self._counter("batchq_generation_tokens", "tokens generated", s.tokens_generated)
        yield self._counter(
            "batchq_preemptions",
            "sequences preempted when the KV pool ran out (recomputed later)",
            s.preemptions,
        )
        # EngineStats' split: a step with prompt chunks is "prefill" (decode rows may ride along), a
        # decode-only step "decode", a `choices` label-scoring step "score".
        yield self._by(
            "batchq_engine_steps", "engine steps (forward passes) by phase", "phase",
            {"prefill": s.prefill_steps, "decode": s.steps - s.prefill_steps - s.score_steps,
             "score": s.score_steps},
        )  # fmt: skip
        yield self._by(
            "batchq_engine_step_seconds", "time in forward passes by phase", "phase",
            {"prefill": s.prefill_s, "decode": s.decode_s, "score": s.score_s},
        )  # fmt: skip
        if s.expert_tokens:
            experts = CounterMetricFamily(
                "batchq_moe_expert_tokens",
                "mixture-of-experts routings: tokens each expert of each layer received (a pick of top-k each)",
                labels=[*LABELS, "layer", "expert"],
            )
            for layer, counts in s.expert_tokens.items():
                for e, n in enumerate(counts):
                    experts.add_metric([*self.values, str(layer), str(e)], n)
            yield experts
        depth = self.depth()
        if depth is not None:
            yield self._gauge(
                "batchq_queue_depth",
                "requests in the worker's queue, queued or running (arq keeps a job there until it ends)",
                depth,
            )
        errors, retries = REDIS_ERRORS_SEEN.read()
        yield self._by(
            "batchq_redis_errors",
            "Redis errors the worker caught and survived, by operation: " + "; ".join(
                f"{k}: {v}" for k, v in REDIS_OPERATIONS.items()
            ),
            "operation",
            {k: float(v) for k, v in errors.items()},
        )  # fmt: skip
        yield self._counter(
            "batchq_redis_retries",
            "Redis operations tried again after an error (requests and polls)",
            retries,
        )


Health = Callable[[], tuple[bool, dict[str, object]]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # a probe every few seconds: no log line each
        pass


def _app(registry: CollectorRegistry, health: Health) -> WSGIApplication:
    """prometheus_client's app (it answers any other path with the metrics), and /health beside it."""
    metrics: WSGIApplication = make_wsgi_app(registry)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/health":
            return metrics(environ, start_response)
        ok, body = health()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [orjson.dumps(body)]

    return app


class WorkerMetrics:
    """The worker's registry: the collector above, and what results add one by one."""

    def __init__(self, cfg: WorkerConfig, engine: AsyncEngine) -> None:
        # No `_created` series beside every counter and histogram (prometheus_client's switch is global).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.labels = {"model": cfg.engine.model, "queue": queue_label(cfg.queue), "worker": cfg.worker_id}
        self.registry = CollectorRegistry(auto_describe=False)
        self.depth = QueueDepth(cfg.redis_url, keys.queue_name(cfg.queue))
        self.registry.register(WorkerCollector(self.labels, engine, EngineFacts.of(engine), self.depth))
        ProcessCollector(registry=self.registry)  # process_*: CPU seconds, resident memory, open files
        self._served = cfg.engine.model
        self._finished_by = Counter(
            "batchq_requests_finished",
            'results this worker stored, by finish reason and LoRA adapter (lora="": the base model; '
            "result-cache answers included)",
            [*LABELS, "finish_reason", "lora"],
            registry=self.registry,
        )
        self._finished = {r: self._finished_by.labels(**self.labels, finish_reason=r, lora="")
                          for r in get_args(FinishReason)}  # fmt: skip
        self._tokens_by = Counter(
            "batchq_lora_generated_tokens",
            "tokens generated for requests of each LoRA adapter",
            [*LABELS, "lora"],
            registry=self.registry,
        )
        self._cache_hits = Counter(
            "batchq_result_cache_hits",
            "results answered from the result cache instead of the engine",
            LABELS,
            registry=self.registry,
        ).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(**self.labels)

        self._queue_time = histogram(
            "batchq_request_queue_time_seconds",
            "from enqueue to a worker picking the request up",
            LATENCY_BUCKETS,
        )
        self._ttft = histogram(
            "batchq_time_to_first_token_seconds", "from pick-up to the first generated token", TTFT_BUCKETS
        )
        self._latency = histogram(
            "batchq_request_latency_seconds", "end to end: from enqueue to the stored result", LATENCY_BUCKETS
        )
        self._shutdown: Callable[[], None] | None = None

    def observe(self, result: Result) -> None:
        """A result this worker stored (its write was the first): called once per request."""
        lora = result.model if result.model and result.model != self._served else ""  # an adapter answered
        if lora:
            self._finished_by.labels(**self.labels, finish_reason=result.finish_reason, lora=lora).inc()
            self._tokens_by.labels(**self.labels, lora=lora).inc(result.usage.completion_tokens)
        else:
            self._finished[result.finish_reason].inc()
        if result.cached:
            self._cache_hits.inc()
        t = result.timing
        if t.queued_s is not None:
            self._queue_time.observe(t.queued_s)
        if t.ttft_s is not None:
            self._ttft.observe(t.ttft_s)
        if t.total_s is not None:
            self._latency.observe((t.queued_s or 0.0) + t.total_s)

    def serve(self, port: int, health: Health) -> int:
        """Serve /metrics and /health (`health()`: health.Liveness.report) on all interfaces, from a
        thread; -> the port (port 0 picks a free one)."""
        try:
            server = make_server("0.0.0.0", port, _app(self.registry, health), ThreadingWSGIServer, _Quiet)
        except OSError as e:
            raise ValueError(f"--metrics-port {port}: {e.strerror or e}") from None
        threading.Thread(target=server.serve_forever, name="batchq-metrics", daemon=True).start()

        def shutdown() -> None:
            server.shutdown()
            server.server_close()

        self._shutdown = shutdown
        return int(server.server_port)

    def close(self) -> None:
        if self._shutdown is not None:
            self._shutdown()
            self._shutdown = None
        self.depth.close()
