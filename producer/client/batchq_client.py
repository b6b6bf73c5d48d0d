"""The async Python API of the producer (the CLI is a thin layer over it), for nightly jobs in Python.

async with BatchqClient.from_url("redis://localhost:6379/0") as client:
    report = await client.submit_file("prompts.jsonl", defaults=SamplingParams(temperature=0))
    status = await client.wait(report.batch_id, timeout=3600)
    async for result in client.results(report.batch_id):
        ...
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from redis.asyncio import Redis

from producer.client.images import ImageLimits
from producer.client.live_workers import live_workers
from producer.client.queue_load import QueueLoad, queue_loads
from producer.client.retry import RetryReport, Selection, finish_reasons, retry_batch
from producer.client.submit import InputError, SubmitReport, submit_stream
from producer.wire import keys, store
from producer.wire.redis_url import connect
from producer.wire.request_params import SamplingParams
from producer.wire.results import BatchStatus, Result
from producer.wire.workers import Heartbeat

ProgressFn = Callable[[BatchStatus], Awaitable[None] | None]


class WaitTimeout(TimeoutError):
    def __init__(self, status: BatchStatus, timeout: float) -> None:
        super().__init__(
            f"batch {status.batch_id!r} not finished after {timeout:g}s ({status.done}/{status.total} done)"
        )
        self.status = status


class _LineReader(io.RawIOBase):
    """Presents an iterable of str/bytes lines as a binary stream for the JSONL reader."""

    def __init__(self, lines: Iterable[str | bytes]) -> None:
        self._it = iter(lines)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                line = next(self._it)
            except StopIteration:
                return 0
            raw = line.encode() if isinstance(line, str) else line
            self._buf = raw if raw.endswith(b"\n") else raw + b"\n"
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class BatchqClient:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    @classmethod
    def from_url(cls, url: str) -> BatchqClient:
        """redis://, rediss:// (TLS), user:password@ and redis+sentinel://h1:26379,h2:26379/master/db URLs."""
        return cls(connect(url, socket_connect_timeout=5, health_check_interval=30))

    async def __aenter__(self) -> BatchqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.redis.aclose()

    async def submit_file(
        self,
        path_or_stdin: str | Path | IO[bytes],
        *,
        defaults: SamplingParams | None = None,
        batch_id: str | None = None,
        queue: str | None = None,
        model: str | None = None,
        model_aliases: Mapping[str, str] | None = None,
        skip_invalid: bool = False,
        result_ttl_s: int = keys.DEFAULT_RESULT_TTL_S,
        result_cache: bool = True,
        on_created: Callable[[str], None] | None = None,
        offload: bool = False,
        owner: str | None = None,
        image_limits: ImageLimits | None = None,
    ) -> SubmitReport:
        """Submit a JSONL file ("-" reads stdin). Raises InputError, and enqueues nothing, on bad input.

        `batch_id`: the same content again under an existing id is a no-op (it finishes an interrupted
        submit); other content is refused with InputError, naming the first line that differs.
        `model`: for lines that name none; `model_aliases`: {name a line gives: model the workers serve}.
        result_cache=False: every request is computed afresh, even where workers hold its answer.
        offload=True: validate the lines in a thread, so that the caller's event loop (a server's) keeps
        serving meanwhile. `image_limits`: what one image and one request may hold; file:// image paths
        resolve in the file's folder (stdin's: the current directory; an open stream has none)."""
        opts: dict[str, Any] = dict(
            batch_id=batch_id,
            queue=queue,
            model=model,
            model_aliases=model_aliases,
            defaults=defaults,
            skip_invalid=skip_invalid,
            result_ttl_s=result_ttl_s,
            result_cache=result_cache,
            on_created=on_created,
            offload=offload,
            owner=owner,
            image_limits=image_limits,
        )
        if not isinstance(path_or_stdin, str | Path):
            return await submit_stream(self.redis, path_or_stdin, **opts)
        if str(path_or_stdin) == "-":
            return await submit_stream(self.redis, sys.stdin.buffer, image_folder=Path.cwd(), **opts)
        path = Path(path_or_stdin)
        if not path.exists() or path.is_dir():  # pipes such as <(zcat x.gz) are fine, folders are not
            raise InputError(f"no such file: {path}")
        with path.open("rb") as f:
            try:
                return await submit_stream(self.redis, f, image_folder=path.absolute().parent, **opts)
            except InputError as e:
                e.args = (f"{path}: {e}",)  # name the file in the one-line message
                raise

    async def submit_lines(self, lines: Iterable[str | bytes], **kwargs: Any) -> SubmitReport:
        """Like submit_file, for JSONL lines (or dicts already dumped to str) produced in Python."""
        with io.BufferedReader(_LineReader(lines)) as stream:
            return await submit_stream(self.redis, stream, **kwargs)

    async def status(self, batch_id: str) -> BatchStatus:
        return await store.get_status(self.redis, batch_id)

    async def wait(
        self,
        batch_id: str,
        timeout: float | None = None,
        on_progress: ProgressFn | None = None,
        *,
        poll_s: float = 0.5,
    ) -> BatchStatus:
        """Poll until every request has a result. Raises WaitTimeout after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = await self.status(batch_id)
            if on_progress is not None:
                maybe = on_progress(status)
                if maybe is not None:
                    await maybe
            if status.done >= status.total:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(status, timeout or 0.0)
            left = poll_s if deadline is None else min(poll_s, max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(left)

    async def results(self, batch_id: str) -> AsyncIterator[Result]:
        """Results in input order (requests still running are skipped)."""
        async for result, _chat in store.iter_results(self.redis, batch_id):
            yield result

    async def results_with_kind(self, batch_id: str) -> AsyncIterator[tuple[Result, bool]]:
        """(result, was_chat) in input order: what the OpenAI output format needs."""
        async for pair in store.iter_results(self.redis, batch_id):
            yield pair

    async def retry(
        self, batch_id: str, *, failed: bool = False, cancelled: bool = False, timed_out: bool = False
    ) -> RetryReport:
        """Enqueue the batch's failed / cancelled / timed-out requests again (none chosen: all three) as new
        attempts; each new result replaces the old one, and a request already being retried is skipped."""
        flags: tuple[tuple[Selection, bool], ...] = (
            ("failed", failed),
            ("cancelled", cancelled),
            ("timed-out", timed_out),
        )
        chosen = [name for name, on in flags if on]
        return await retry_batch(self.redis, batch_id, finish_reasons(chosen))

    async def cancel(self, batch_id: str) -> int:
        return await store.cancel_batch(self.redis, batch_id)

    async def list_batches(self, limit: int = 50) -> list[BatchStatus]:
        return await store.list_batches(self.redis, limit=limit)

    async def owned_batches(
        self, owner: str | None, queue: str | None, limit: int = 100
    ) -> list[BatchStatus]:
        """The newest batches on `queue` that `owner` (an owner id, producer/wire/owner.py) owns; None:
        every batch on the queue."""
        return await store.owned_batches(self.redis, owner=owner, queue=keys.queue_name(queue), limit=limit)

    async def input_excerpts(self, batch_id: str, indices: list[int]) -> dict[int, str]:
        """Excerpts of the inputs of requests `indices` (as submit kept them), by index."""
        return await store.get_excerpts(self.redis, batch_id, indices)

    async def workers(self, queue: str | None = None) -> list[Heartbeat]:
        """Live workers (those on `queue` only, when given), from their heartbeats."""
        return await live_workers(self.redis, queue)

    async def queue_loads(self, always: Iterable[str | None] = ()) -> dict[str, QueueLoad]:
        """Pending work (queued + running) per queue, by short name; the queues `always` even when idle."""
        return await queue_loads(self.redis, always)

    async def batch_meta(self, batch_id: str) -> dict[str, str]:
        return await store.get_meta(self.redis, batch_id)
