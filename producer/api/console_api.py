"""The batch console of `producer serve`: its static page (producer/api/console/, served at / and /console)
and the JSON endpoints it reads, under /console/api, behind the same bearer keys as /v1.

A key sees the batches of its team: the batches on the served queue whose batchq meta names the key's
owner id, i.e. those created through the API with it and those `producer submit` ran with it in
$BATCHQ_API_KEY. Any other batch id answers 404, as the API answers for another key's objects. Without
keys (--allow-no-auth) every batch on the queue is visible, as everything is on an open API.
Cancel and retry are the CLI's operations through BatchqClient (an API batch is cancelled through its
BatchStore, so its OpenAI status follows); downloads are the lines `producer results` writes.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from producer.api.batches import BatchStore
from producer.api.common import ApiError, not_found
from producer.api.console_report import BatchReport, least_confident, shared_start
from producer.client.batchq_client import BatchqClient
from producer.client.openai_format import is_error_line, openai_line, output_model_and_created
from producer.wire import keys
from producer.wire.owner import OPEN_OWNER
from producer.wire.results import BatchStatus
from producer.wire.store import BatchNotFound
from producer.wire.workers import queue_label

STATIC = Path(__file__).with_name("console")
# The page's files, each served at /console/<name>; app.js is the entry module, importing the others.
SCRIPTS = ("app.js", "api.js", "dom.js", "widgets.js", "lists.js", "batch.js", "labels.js")
ASSETS = {"index.html": "text/html", "style.css": "text/css", **dict.fromkeys(SCRIPTS, "text/javascript")}
# No inline script or style, nothing from another origin, never framed (clickjacking on the buttons).
CSP = "default-src 'self'; script-src 'self'; object-src 'none'; frame-ancestors 'none'"
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
MAX_ROWS = 500  # least-confident rows per page of the labels table
RETRY_FLAGS = ("failed", "cancelled", "timed_out")


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, {"Cache-Control": "no-store"}, media_type="application/json")


# (path, Console method, HTTP method): served behind the API's keys (server.py routes them).
CONSOLE_ENDPOINTS = (
    ("/console/api/batches", "list_batches", "GET"),
    ("/console/api/batches/{batch_id}", "get_batch", "GET"),
    ("/console/api/batches/{batch_id}/report", "batch_report", "GET"),
    ("/console/api/batches/{batch_id}/cancel", "cancel", "POST"),
    ("/console/api/batches/{batch_id}/retry", "retry", "POST"),
    ("/console/api/batches/{batch_id}/labels", "labels", "GET"),
    ("/console/api/batches/{batch_id}/labels.jsonl", "labels_export", "GET"),
    ("/console/api/batches/{batch_id}/download", "download", "GET"),
    ("/console/api/workers", "workers", "GET"),
)


def page_routes() -> list[Route]:
    """The page and its files: no data in them, so no key needed. Read once here (a missing file is a
    broken install: it fails at start-up, not at the first visit)."""

    def asset(name: str) -> Callable[[Request], Awaitable[Response]]:
        body = (STATIC / name).read_bytes()

        async def endpoint(request: Request) -> Response:
            return Response(body, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

        return endpoint

    page = asset("index.html")
    return [
        Route("/", page, methods=["GET"]),
        Route("/console", page, methods=["GET"]),
        *(Route(f"/console/{name}", asset(name), methods=["GET"]) for name in ASSETS if name != "index.html"),
    ]


def status_row(st: BatchStatus, now: float) -> dict[str, Any]:
    """A batch as the console's tables show it: `producer status`'s partition and its token counters."""
    return {
        "id": st.batch_id,
        "state": st.state,
        "model": st.model,
        "total": st.total,
        "queued": st.queued,
        "running": st.running,
        "completed": st.completed,
        "failed": st.failed,
        "cancelled": st.cancelled,
        "timed_out": st.timed_out,
        "length": st.length,
        "retrying": st.retrying,
        "done": st.done,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "cached_prompt_tokens": st.cached_prompt_tokens,
        "reasoning_tokens": st.reasoning_tokens,
        "tokens_generated": st.tokens_generated,
        "from_result_cache": st.from_result_cache,
        "created_at": st.created_at,
        "finished_at": st.finished_at,
        "now": now,
    }


def _float_param(raw: str | None, name: str) -> float | None:
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ApiError(400, f"{name} must be a probability from 0 to 1, got {raw!r}", param=name)
    return value


class Console:
    def __init__(self, client: BatchqClient, batches: BatchStore, *, queue: str | None) -> None:
        self.client = client
        self.batches = batches
        self.queue = keys.queue_name(queue)

    async def _owned(self, owner: str, batch_id: str) -> BatchStatus:
        """The caller's batch on the served queue; 404 for any other id, whether or not it exists."""
        try:
            meta = await self.client.batch_meta(batch_id) if len(batch_id) <= 128 else {}
        except BatchNotFound:
            meta = {}
        mine = owner == OPEN_OWNER or hmac.compare_digest(meta.get("owner", ""), owner)
        if not meta or not mine or meta.get("queue") != self.queue or "total" not in meta:
            raise not_found("Batch", batch_id)
        return await self.client.status(batch_id)

    async def _report(self, st: BatchStatus) -> BatchReport:
        report = BatchReport(created_at=st.created_at)
        async for result in self.client.results(st.batch_id):
            report.add(result)
        return report

    # ---- the endpoints; each gets the caller's owner id, checked before it runs ----

    async def list_batches(self, request: Request, owner: str) -> Response:
        who = None if owner == OPEN_OWNER else owner
        rows = await self.client.owned_batches(who, self.queue, limit=100)
        now = time.time()
        return _json({"queue": queue_label(self.queue), "batches": [status_row(s, now) for s in rows]})

    async def get_batch(self, request: Request, owner: str) -> Response:
        st = await self._owned(owner, request.path_params["batch_id"])
        row = status_row(st, time.time())
        try:  # an API batch: its OpenAI status and files too (reading it moves it on, as the API's reads do)
            obj = await self.batches.get(owner, st.batch_id)
            row["api"] = {k: obj[k] for k in ("status", "output_file_id", "error_file_id", "endpoint")}
        except ApiError:
            row["api"] = None
        return _json(row)

    async def batch_report(self, request: Request, owner: str) -> Response:
        st = await self._owned(owner, request.path_params["batch_id"])
        return _json({"id": st.batch_id, **(await self._report(st)).summary()})

    async def cancel(self, request: Request, owner: str) -> Response:
        """`producer cancel`, refused (409) when every request has its result already."""
        st = await self._owned(owner, request.path_params["batch_id"])
        if st.done >= st.total:
            raise ApiError(
                409, f"batch {st.batch_id} is {st.state}: nothing is left to cancel", code="finished"
            )
        try:
            await self.batches.cancel(owner, st.batch_id)
            cancelled = None
        except ApiError as e:
            if e.code == "not_cancellable":
                raise
            cancelled = await self.client.cancel(st.batch_id)  # not an API batch: the CLI's cancel
        st = await self.client.status(st.batch_id)
        return _json(
            {"cancelled_queued": cancelled, "running": st.running, "batch": status_row(st, time.time())}
        )

    async def retry(self, request: Request, owner: str) -> Response:
        """`producer retry` with its flags as a JSON body ({} or no flag set: all three)."""
        st = await self._owned(owner, request.path_params["batch_id"])
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict) or set(body) - set(RETRY_FLAGS):
            raise ApiError(400, f"the body takes the flags {', '.join(RETRY_FLAGS)} (true/false)")
        if not all(isinstance(v, bool) for v in body.values()):
            raise ApiError(400, "retry flags are true or false")
        report = await self.client.retry(st.batch_id, **body)
        return _json(report.to_dict())

    async def labels(self, request: Request, owner: str) -> Response:
        st = await self._owned(owner, request.path_params["batch_id"])
        q = request.query_params
        label, max_prob = q.get("label") or None, _float_param(q.get("max_prob"), "max_prob")
        report = await self._report(st)
        summary = report.labels()
        if summary is None:
            raise ApiError(
                400, f"batch {st.batch_id} has no label scores (not a `choices` batch)", code="no_labels"
            )
        rows = least_confident(report.label_rows, label=label, max_prob=max_prob)
        shown = rows[:MAX_ROWS]
        excerpts = await self.client.input_excerpts(st.batch_id, [r.index for r in shown])
        # The instruction every shown row repeats is said once; each row shows what differs from it.
        shared = shared_start([excerpts.get(r.index, "") for r in shown])
        summary["least_confident"] = [r.to_dict(excerpts.get(r.index, ""), shared) for r in shown]
        summary["input_shared"] = shared
        summary["matching"] = len(rows)
        return _json({"id": st.batch_id, **summary})

    async def labels_export(self, request: Request, owner: str) -> Response:
        """The filtered rows, least confident first, one JSON object a line: a review file."""
        st = await self._owned(owner, request.path_params["batch_id"])
        q = request.query_params
        label, max_prob = q.get("label") or None, _float_param(q.get("max_prob"), "max_prob")
        rows = least_confident((await self._report(st)).label_rows, label=label, max_prob=max_prob)

        async def lines() -> AsyncIterator[bytes]:
            for start in range(0, len(rows), 500):
                part = rows[start : start + 500]
                excerpts = await self.client.input_excerpts(st.batch_id, [r.index for r in part])
                for r in part:
                    yield orjson.dumps(r.to_dict(excerpts.get(r.index, ""))) + b"\n"

        return _download(lines(), f"{st.batch_id}_review.jsonl")

    async def download(self, request: Request, owner: str) -> Response:
        """The output or error file (failed and cancelled requests), as OpenAI lines or batchq's JSONL."""
        st = await self._owned(owner, request.path_params["batch_id"])
        kind, fmt = request.query_params.get("file", "output"), request.query_params.get("format", "openai")
        if kind not in ("output", "errors") or fmt not in ("openai", "jsonl"):
            raise ApiError(400, "file is output or errors, format is openai or jsonl", param="file")
        model, created = output_model_and_created(await self.client.batch_meta(st.batch_id))

        async def lines() -> AsyncIterator[bytes]:
            async for result, chat in self.client.results_with_kind(st.batch_id):
                if is_error_line(result) != (kind == "errors"):
                    continue
                if fmt == "openai":
                    yield openai_line(result, chat=chat, batch_id=st.batch_id, model=model, created=created)
                else:
                    yield result.to_user_json()
                yield b"\n"

        suffix = "" if fmt == "openai" else "_batchq"
        return _download(lines(), f"{st.batch_id}_{kind}{suffix}.jsonl")

    async def workers(self, request: Request, owner: str) -> Response:
        now = time.time()
        rows = [w.to_row(now) for w in await self.client.workers(self.queue)]
        return _json({"queue": queue_label(self.queue), "workers": rows, "now": now})


def _download(lines: AsyncIterator[bytes], filename: str) -> Response:
    return StreamingResponse(
        lines,
        media_type="application/x-ndjson",
        headers={"Content-Disposition": f'attachment; filename="{filename}"', "Cache-Control": "no-store"},
    )
