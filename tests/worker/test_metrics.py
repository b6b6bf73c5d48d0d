"""Worker metrics scraped over HTTP from a real worker process, the Grafana dashboard's PromQL checked
against them, and `producer workers` / `producer top` / `producer wait` against the same live worker.

One tiny-model worker (module-scoped) on a Redis of this module's own serves every test here.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from producer.wire import store
from producer.wire.results import BatchStatus
from tests.worker.conftest import ROOT, Worker, batch_state, submit, wait_until, write_jsonl
from worker.embedded_redis import RedisServer

pytestmark = pytest.mark.slow

QUEUE = "metrics"
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "batchq.json"
PROVISIONED = ROOT / "configs" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
SHARED = "You label support tickets. Answer with one word: billing, bug, account or other. Ticket: "


@dataclass
class LiveWorker:
    url: str
    worker: Worker
    port: int
    model: str


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWorker]:
    with RedisServer(appendonly=False) as srv:
        w = Worker(srv.url, str(tiny_model_dir), tmp_path_factory.mktemp("metrics"), "metrics",
                   "--queue", QUEUE, "--metrics-port", "0", "--dtype", "float32", "--max-num-seqs", "4", "--prefetch", "2")  # fmt: skip
        try:
            w.wait_ready()
            row = workers_json(srv.url)[0]
            yield LiveWorker(srv.url, w, int(row["metrics_port"]), str(tiny_model_dir))
        finally:
            w.stop()


def producer(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "producer.cli", *args, "--redis-url", url]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False)


def workers_json(url: str) -> list[dict[str, Any]]:
    out = producer(url, "workers", "--json")
    assert out.returncode == 0, out.stderr
    return [orjson.loads(line) for line in out.stdout.splitlines()]


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def status_of(url: str, batch_id: str) -> BatchStatus:
    async def get() -> BatchStatus:
        redis = Redis.from_url(url)
        try:
            return await store.get_status(redis, batch_id)
        finally:
            await redis.aclose()

    return asyncio.run(get())


def test_counters_agree_with_the_batch_status_during_and_after_a_batch(
    live: LiveWorker, tmp_path: Path
) -> None:
    _, before = scrape(live.port)
    lines = [{"id": f"t{i}", "prompt": SHARED + f"ticket number {i} about item {i * 7}", "max_new_tokens": 12 + i,
              "temperature": 0, "ignore_eos": True} for i in range(12)]  # fmt: skip
    lines.append({"id": "huge", "prompt": "word " * 3000, "max_new_tokens": 4})  # fails: prompt_too_long
    bid = submit(live.url, write_jsonl(tmp_path / "in.jsonl", lines), "--queue", QUEUE, "--no-result-cache")
    waiter = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "wait", bid, "--timeout", "60", "--redis-url", live.url],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    # During the batch: the counters run ahead of (or equal) what the batch has stored so far.
    wait_until(lambda: status_of(live.url, bid).done >= 1, 60, "a first result")
    mid_status = status_of(live.url, bid)
    _, mid = scrape(live.port)
    gen = "batchq_generation_tokens_total"
    assert value(mid, gen) - value(before, gen) >= mid_status.completion_tokens
    finished = "batchq_requests_finished_total"
    assert value(mid, finished) - value(before, finished) >= mid_status.done
    assert 0 <= value(mid, "batchq_queue_depth") <= len(lines)

    _, stderr = waiter.communicate(timeout=90)
    assert waiter.returncode == 4, stderr  # the over-long prompt failed
    assert "no live worker" not in stderr  # the worker is live: `wait` does not warn
    status = status_of(live.url, bid)
    wait_until(
        lambda: value(scrape(live.port)[1], finished) - value(before, finished) == len(lines), 10, "observed"
    )
    _, after = scrape(live.port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    results = list(batch_state(live.url, bid)["results"].values())
    assert delta(gen) == status.completion_tokens == sum(r["usage"]["completion_tokens"] for r in results)
    assert delta("batchq_prompt_tokens_total") == status.prompt_tokens
    assert delta("batchq_prompt_tokens_cached_total") == status.cached_prompt_tokens > 0  # the shared prefix
    reasons = Counter(r["finish_reason"] for r in results)
    assert reasons["error"] == 1 and reasons["length"] == 12
    for reason in ("eos", "stop", "length", "timeout", "repetition", "cancelled", "error"):
        assert delta(finished, finish_reason=reason) == reasons[reason], reason
    assert status.completed == delta(finished) - delta(finished, finish_reason="error")
    assert status.failed == delta(finished, finish_reason="error") == 1

    ttft = [r["timing"]["ttft_s"] for r in results if r["timing"]["ttft_s"] is not None]
    assert delta("batchq_time_to_first_token_seconds_count") == len(ttft) == 12
    assert delta("batchq_time_to_first_token_seconds_sum") == pytest.approx(sum(ttft), rel=1e-6, abs=1e-6)
    timed = [r["timing"] for r in results if r["timing"]["total_s"] is not None]
    e2e = sum(t["queued_s"] + t["total_s"] for t in timed)
    assert delta("batchq_request_latency_seconds_count") == len(timed)
    assert delta("batchq_request_latency_seconds_sum") == pytest.approx(e2e, rel=1e-6, abs=1e-6)
    assert delta("batchq_request_queue_time_seconds_count") == len(timed)
    assert delta("batchq_request_latency_seconds_bucket", le="+Inf") == len(timed)
    # Each generated token of a request comes from a step of its own (the first from its prefill's).
    assert delta("batchq_engine_steps_total", phase="prefill") >= 1
    assert delta("batchq_engine_steps_total") >= max(r["usage"]["completion_tokens"] for r in results)
    assert delta("batchq_engine_step_seconds_total") > 0
    assert value(after, "batchq_queue_depth") == 0
    assert value(after, "batchq_requests_running") == value(after, "batchq_requests_waiting") == 0
    assert value(after, "batchq_kv_cache_blocks") > 0


def test_every_series_carries_the_worker_labels_and_the_info_metric_describes_it(live: LiveWorker) -> None:
    text, samples = scrape(live.port)
    labels = {"model": live.model, "queue": QUEUE, "worker": live.worker.id}
    batchq = [(n, dict(ls)) for n, ls in samples if n.startswith("batchq_")]
    assert batchq and all(ls.items() >= labels.items() for _, ls in batchq)
    assert not [n for n, _ in samples if n.endswith("_created")]
    (info,) = [ls for n, ls in batchq if n == "batchq_worker_info"]
    assert info["version"] == importlib.metadata.version("batchq")
    assert (info["device"], info["dtype"], info["kv_cache_dtype"]) == ("cpu", "float32", "float32")
    assert int(info["kv_blocks"]) == value(samples, "batchq_kv_cache_blocks") and info["block_size"] == "16"
    for name in ("batchq_prompt_tokens", "batchq_generation_tokens", "batchq_requests_finished"):
        assert f"# TYPE {name}_total counter" in text
    assert "# TYPE batchq_time_to_first_token_seconds histogram" in text
    ops = {ls["operation"] for n, ls in batchq if n == "batchq_redis_errors_total"}
    assert {"request", "poll", "housekeeping", "scrape"} <= ops  # every series exists before any error


KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are neither functions, keywords, label
    names (in matchers and by/without/on lists), strings nor durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", e):
        if m.group() not in KEYWORDS and not e[m.end() :].lstrip().startswith("("):
            names.add(m.group())
    return names


def test_promql_name_parser_finds_metric_names_only() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, worker) (rate(x_seconds_bucket{queue=~"$q", a="b(c)"}[5m]))) '
            "/ on (worker) group_left sum(y_total offset 1h) > bool 0")  # fmt: skip
    assert promql_metric_names(expr) == {"x_seconds_bucket", "y_total"}


def test_every_dashboard_expression_names_only_metrics_the_worker_exports(live: LiveWorker) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = set().union(*(promql_metric_names(e) for e in exprs))
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
        assert m is not None and m.group(2) == var["name"], var
        used.add(m.group(1))
    _, samples = scrape(live.port)
    exported = {n for n, _ in samples}
    assert used - exported == set(), f"the dashboard queries metrics no worker exports: {used - exported}"
    wanted = {"batchq_generation_tokens_total", "batchq_kv_cache_blocks_used", "batchq_requests_running",
              "batchq_requests_waiting", "batchq_time_to_first_token_seconds_bucket",
              "batchq_request_latency_seconds_bucket", "batchq_requests_finished_total", "batchq_queue_depth"}  # fmt: skip
    assert wanted <= used, f"panels missing: {wanted - used}"
    uid = re.search(r"uid: (\S+)", PROVISIONED.read_text())
    assert uid is not None and {p["datasource"]["uid"] for p in dash["panels"]} == {uid.group(1)}


def test_producer_workers_lists_the_live_worker(live: LiveWorker) -> None:
    (row,) = [r for r in workers_json(live.url) if r["worker_id"] == live.worker.id]
    assert (row["host"], row["model"], row["queue"]) == (socket.gethostname(), live.model, QUEUE)
    assert (row["device"], row["dtype"], row["version"]) == (
        "cpu",
        "float32",
        importlib.metadata.version("batchq"),
    )
    assert row["metrics_port"] == live.port and 0 <= row["heartbeat_age_s"] < 3
    assert row["kv_blocks_total"] > 0 and 0 <= row["kv_pct"] <= 100
    assert isinstance(row["tok_s"], float) and row["running"] >= 0 and row["waiting"] >= 0
    plain = producer(live.url, "workers")
    assert plain.returncode == 0 and live.worker.id in plain.stdout and "KV %" in plain.stdout
    assert producer(live.url, "workers", "--queue", "elsewhere", "--json").stdout == ""


def test_producer_top_snapshot_shows_the_worker_and_an_active_batch(live: LiveWorker, tmp_path: Path) -> None:
    # A batch on a queue no worker serves stays queued: top must show it beside the live worker.
    path = write_jsonl(tmp_path / "idle.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    bid = submit(live.url, path, "--queue", "idle")
    out = producer(live.url, "top")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "1 live worker, 1 active batch" in lines[0]
    (worker_line,) = [x for x in lines if x.startswith(live.worker.id)]
    assert " cpu " in worker_line and f" {QUEUE} " in worker_line
    (batch_line,) = [x for x in lines if x.startswith(bid)]
    assert " idle " in batch_line and "0/3 0%" in batch_line and "--:--" in batch_line
