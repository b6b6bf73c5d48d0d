"""The HTTP API's app: OpenAI's Files and Batches API over batchq, on Starlette (`producer serve` runs it:
producer/api/serve.py), and the batch console in the browser (console_api.py) at / and /console.

The official `openai` client works against it unchanged (base_url=http://HOST:PORT/v1). Every /v1 route
needs a bearer API key (auth.py) and sees only that key's objects; other keys' ids answer 404. Objects
live in Redis (files.py, batches.py), so instances behind a load balancer share them and a restart loses
nothing. Request bodies are capped (uploads --max-upload-mb, any other body MAX_BODY_BYTES).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.api.auth import ApiKeys
from producer.api.batch_object import expires_after
from producer.api.batches import BatchStore
from producer.api.common import ApiError, parse_limit
from producer.api.console_api import CONSOLE_ENDPOINTS, SECURITY_HEADERS, Console, page_routes
from producer.api.files import FileStore
from producer.api.metrics import CONTENT_TYPE, render
from producer.client.batchq_client import BatchqClient
from producer.wire import keys
from producer.wire.lua import done

log = logging.getLogger("batchq.server")

MAX_BODY_BYTES = 1024 * 1024  # any body but an upload: a batch request is a few hundred bytes
DRAIN_BYTES = 64 * 1024 * 1024  # an over-long body up to this much is read off before the 413 (see BodyLimit)


@dataclass(frozen=True)
class ServerSettings:
    redis_url: str
    keys: ApiKeys
    queue: str | None = None
    model: str | None = None
    model_aliases: tuple[tuple[str, str], ...] = ()  # a line's body.model -> the model workers serve
    max_upload_bytes: int = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
    # Queues /metrics reports even before their first batch (the server's own `queue` always is).
    metrics_queues: tuple[str, ...] = ()


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers, media_type="application/json")


def _error(e: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return _json(e.body(), e.status, headers)


class SecurityHeaders:
    """Adds the console's Content-Security-Policy and its companions to every response: the page may run
    only its own script file, load nothing from another origin and never be framed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        await self.app(scope, receive, with_headers)


class BodyLimit:
    """Refuses a request body over its limit with 413 without storing it: uploads (POST /v1/files) may be
    `upload_bytes`, other bodies MAX_BODY_BYTES. A declared Content-Length over the limit is refused before
    the app runs (after reading off up to DRAIN_BYTES, so the client gets the answer, not a reset socket);
    an undeclared (chunked) body is cut off when it passes the limit."""

    def __init__(self, app: ASGIApp, *, upload_bytes: int) -> None:
        self.app = app
        self.upload_bytes = upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") == "/v1/files"
        limit = self.upload_bytes if upload else MAX_BODY_BYTES
        too_large = ApiError(413, f"request body over the limit of {limit} bytes", code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= limit + DRAIN_BYTES:
                more = True
                while more:
                    message = await receive()
                    more = message.get("more_body", False) and message["type"] == "http.request"
            await _error(too_large)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
            return message

        await self.app(scope, limited, send)


Handler = Callable[["Api", Request, str], Awaitable[Response]]


class Api:
    """The route handlers; each gets the caller's owner id (auth.owner_id), checked before it runs."""

    def __init__(self, client: BatchqClient, settings: ServerSettings) -> None:
        self.client = client
        self.redis = client.redis
        self.files = FileStore(client.redis, settings.queue)
        self.batches = BatchStore(
            client,
            self.files,
            queue=settings.queue,
            model=settings.model,
            aliases=dict(settings.model_aliases),
        )
        self.console = Console(client, self.batches, queue=settings.queue)

    async def upload_file(self, request: Request, owner: str) -> Response:
        async with request.form(max_files=1, max_fields=8) as form:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(
                    400, "'file' is required: a JSONL file sent as multipart/form-data", param="file"
                )
            if form.get("purpose") != "batch":
                raise ApiError(
                    400, "purpose must be 'batch' (batchq stores batch input files)", param="purpose"
                )
            rec = await self.files.upload(
                owner, filename=upload.filename or "input.jsonl", stream=upload.file, ttl_s=_file_ttl(form)
            )
        return _json(rec.to_object())

    async def list_files(self, request: Request, owner: str) -> Response:
        q = request.query_params
        return _json(await self.files.list(owner, after=q.get("after"), limit=parse_limit(q.get("limit"))))

    async def get_file(self, request: Request, owner: str) -> Response:
        return _json((await self.files.get(owner, request.path_params["file_id"])).to_object())

    async def file_content(self, request: Request, owner: str) -> Response:
        rec = await self.files.get(owner, request.path_params["file_id"])
        return StreamingResponse(self.files.blocks(rec), media_type="application/octet-stream")

    async def delete_file(self, request: Request, owner: str) -> Response:
        return _json(await self.files.delete(owner, request.path_params["file_id"]))

    async def create_batch(self, request: Request, owner: str) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from None
        return _json(await self.batches.create(owner, body))

    async def list_batches(self, request: Request, owner: str) -> Response:
        q = request.query_params
        return _json(await self.batches.list(owner, after=q.get("after"), limit=parse_limit(q.get("limit"))))

    async def get_batch(self, request: Request, owner: str) -> Response:
        return _json(await self.batches.get(owner, request.path_params["batch_id"]))

    async def cancel_batch(self, request: Request, owner: str) -> Response:
        return _json(await self.batches.cancel(owner, request.path_params["batch_id"]))


def _file_ttl(form: FormData) -> int:
    """expires_after[anchor] and expires_after[seconds], as the openai client sends them in the form."""
    seconds = form.get("expires_after[seconds]")
    if seconds is None:
        return keys.DEFAULT_FILE_TTL_S
    value = {
        "anchor": form.get("expires_after[anchor]"),
        "seconds": int(seconds) if isinstance(seconds, str) and seconds.isdigit() else seconds,
    }
    return expires_after(value, "expires_after")


def _console_handler(name: str) -> Handler:
    """The route handler that calls the console's method `name` (console.CONSOLE_ENDPOINTS)."""

    async def handler(api: Api, request: Request, owner: str) -> Response:
        bound: Callable[[Request, str], Awaitable[Response]] = getattr(api.console, name)
        return await bound(request, owner)

    return handler


def create_app(settings: ServerSettings) -> Starlette:
    def route(path: str, handler: Handler, method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            header = request.headers.get("authorization")
            owner = settings.keys.owner(header)
            if owner is None:
                why = "Incorrect API key provided" if header else "Missing bearer authentication in header"
                raise ApiError(401, why, code="invalid_api_key")
            api: Api = request.app.state.api
            return await handler(api, request, owner)

        return Route(path, endpoint, methods=[method])

    async def health(request: Request) -> Response:
        await done(request.app.state.api.redis.ping())
        return _json({"status": "ok"})

    async def metrics(request: Request) -> Response:
        # No key: Prometheus scrapes it, and it tells only queue names and request counts.
        api: Api = request.app.state.api
        loads = await api.client.queue_loads((settings.queue, *settings.metrics_queues))
        return Response(render(loads), media_type=CONTENT_TYPE)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        client = BatchqClient.from_url(settings.redis_url)
        app.state.api = Api(client, settings)
        try:
            yield
        finally:
            await app.state.api.batches.close()
            await client.close()

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(ApiError(exc.status_code, str(exc.detail), code=code))

    async def redis_error(request: Request, exc: Exception) -> Response:
        log.warning("Redis error on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return _error(ApiError(503, "the batch store (Redis) is unavailable; retry", type="server_error"))

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _error(ApiError(500, "internal server error", type="server_error"))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        route("/v1/files", Api.upload_file, "POST"),
        route("/v1/files", Api.list_files, "GET"),
        route("/v1/files/{file_id}", Api.get_file, "GET"),
        route("/v1/files/{file_id}", Api.delete_file, "DELETE"),
        route("/v1/files/{file_id}/content", Api.file_content, "GET"),
        route("/v1/batches", Api.create_batch, "POST"),
        route("/v1/batches", Api.list_batches, "GET"),
        route("/v1/batches/{batch_id}", Api.get_batch, "GET"),
        route("/v1/batches/{batch_id}/cancel", Api.cancel_batch, "POST"),
        # The console (producer/api/console_api.py): the page's files need no key, its data does.
        *page_routes(),
        *(route(path, _console_handler(name), method) for path, name, method in CONSOLE_ENDPOINTS),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            RedisError: redis_error,
            Exception: internal_error,
        },
    )
    app.add_middleware(BodyLimit, upload_bytes=settings.max_upload_bytes)
    app.add_middleware(SecurityHeaders)
    return app
