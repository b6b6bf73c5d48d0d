"""Submitting a JSONL stream as a batch, in two passes with bounded memory.

Pass 1 (validate.py) validates every line and writes normalised requests to a temporary spool file, so an
invalid file enqueues nothing; a request whose output is determined gets its result-cache key there. Pass 2
(enqueue.py) creates the batch and goes through the spool in chunks: it answers the requests whose answer
the result cache holds at once and enqueues the rest as arq jobs, written by a Lua script.

This module runs the two passes (submit_stream), and its names are the client's submit API: the two
passes' public names are importable from here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from redis.asyncio import Redis

from producer.client.enqueue import EXCERPT_CHARS, create_batch, enqueue_spool, excerpt
from producer.client.images import ImageChecks, ImageLimits, ImageSpool, store_images
from producer.client.live_workers import ignores_reasoning, live_workers, queue_serving, reasoning_ignored
from producer.client.validate import (
    DIGEST_BYTES,
    ENGINE_TEMPERATURE,
    JSON_AT,
    MAX_REPORTED,
    InputError,
    SubmitChecks,
    SubmitReport,
    check_batch_id,
    new_batch_id,
    queue_order,
    validate_to_spool,
)
from producer.wire import keys
from producer.wire.request_params import SamplingParams

__all__ = [
    "DIGEST_BYTES",
    "ENGINE_TEMPERATURE",
    "EXCERPT_CHARS",
    "JSON_AT",
    "MAX_REPORTED",
    "ImageLimits",
    "InputError",
    "SubmitChecks",
    "SubmitReport",
    "check_batch_id",
    "create_batch",
    "enqueue_spool",
    "excerpt",
    "new_batch_id",
    "queue_order",
    "submit_checks",
    "submit_stream",
    "validate_to_spool",
]


async def submit_stream(
    redis: Redis,
    stream: IO[bytes],
    *,
    batch_id: str | None = None,
    queue: str | None = None,
    model: str | None = None,
    defaults: SamplingParams | None = None,
    skip_invalid: bool = False,
    result_ttl_s: int = keys.DEFAULT_RESULT_TTL_S,
    result_cache: bool = True,
    model_aliases: Mapping[str, str] | None = None,
    on_created: Callable[[str], None] | None = None,
    offload: bool = False,
    owner: str | None = None,
    image_limits: ImageLimits | None = None,
    image_folder: Path | None = None,
) -> SubmitReport:
    """Validate all of `stream`, then enqueue it as one batch. Raises InputError before enqueuing anything.

    `model`: the model lines that name none are for; `model_aliases` map names lines (or `model`) give to
    the name the queue's workers serve. A request for a model no worker of the queue serves fails at the
    worker (error type model_not_found).
    `on_created(batch_id)` is called once the batch exists, before its jobs are enqueued: from then on an
    interrupted submit is finished by submitting again with the same batch id. Requests whose answer the
    result cache holds are answered now and never enqueued (result_cache=False: none are).
    `offload`: validate (pass 1, CPU-bound) in a thread, so that a server's event loop keeps serving.
    `owner`: the owner id (producer/wire/owner.py) of the team the batch belongs to: its console lists it.
    `image_limits`: what an image and a request may hold; `image_folder`: where file:// image paths
    resolve (the JSONL file's folder; None refuses them). The images are stored in Redis, once each, before
    the jobs that show them are enqueued, for `result_ttl_s` (producer/client/images.py).
    """
    report = SubmitReport(batch_id=check_batch_id(batch_id) if batch_id else new_batch_id())
    qname = keys.queue_name(queue)
    aliases = dict(model_aliases or {})
    model = aliases.get(model, model) if model else None
    checks = await submit_checks(
        redis, qname, result_cache=result_cache, aliases=aliases, image_limits=image_limits,
        image_folder=image_folder,
    )  # fmt: skip
    with contextlib.ExitStack() as files:
        spool = files.enter_context(tempfile.TemporaryFile(prefix="batchq-spool-"))
        images = files.enter_context(tempfile.TemporaryFile(prefix="batchq-images-"))
        checks.images.spool = ImageSpool(images)
        validate = functools.partial(
            validate_to_spool,
            stream,
            spool,
            report,
            defaults=defaults,
            model=model,
            result_cache=result_cache,
            checks=checks,
        )
        if offload:
            await asyncio.to_thread(validate)
        else:
            validate()
        if report.total == 0:
            raise InputError("input is empty: no request lines")
        if report.reasoning_ignored and checks.serving is not None:
            report.warnings.append(reasoning_ignored(report.reasoning_ignored, checks.serving, qname))
        if report.invalid and not skip_invalid:
            raise InputError(
                f"{report.invalid} invalid line(s); nothing was enqueued", report.errors, report.invalid
            )
        fresh = await create_batch(
            redis, report, queue=qname, model=model, defaults=defaults, result_ttl_s=result_ttl_s,
            owner=owner,
        )  # fmt: skip
        if on_created is not None:
            on_created(report.batch_id)
        await store_images(redis, checks.images.spool, result_ttl_s)  # before a job can ask for them
        await enqueue_spool(redis, spool, report, queue=qname, fresh=fresh)
    return report


async def submit_checks(
    redis: Redis,
    queue: str,
    *,
    result_cache: bool,
    aliases: Mapping[str, str],
    image_limits: ImageLimits | None = None,
    image_folder: Path | None = None,
) -> SubmitChecks:
    """What serves `queue` (as its workers last published it) and whether a live worker serves it now."""
    serving = await queue_serving(redis, queue)
    images = ImageChecks.for_queue(serving, image_limits, image_folder)
    if serving is None:
        return SubmitChecks(aliases=aliases, images=images)
    live = any(w.model == serving.model for w in await live_workers(redis, queue))
    return SubmitChecks(
        serving=serving,
        fingerprint=serving.fingerprint if result_cache and serving.result_cache else None,
        live_model=serving.model if live else None,
        aliases=aliases,
        ignores_reasoning=live and ignores_reasoning(serving),
        images=images,
    )
