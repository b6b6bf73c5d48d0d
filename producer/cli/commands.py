"""The CLI's commands: each takes parsed arguments, talks to BatchqClient and returns an exit status.

User-facing failures become one line on stderr (no traceback); Redis URLs are shown without passwords.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Coroutine
from contextlib import nullcontext
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

import orjson
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.cli.progress import Progress
from producer.client.batchq_client import BatchqClient, WaitTimeout
from producer.client.grammars import grammar_problem
from producer.client.images import ImageLimits
from producer.client.live_workers import NoWorkerWarning
from producer.client.openai_format import is_error_line, openai_line, output_model_and_created
from producer.client.submit import InputError, SubmitReport, new_batch_id
from producer.wire import keys
from producer.wire.owner import owner_from_env
from producer.wire.request_params import SamplingParams, defaults_base
from producer.wire.results import BatchStatus
from producer.wire.serde import mask_url
from producer.wire.store import BatchNotFound, counter_for

OK, FAILED, INVALID, TIMED_OUT, SOME_FAILED, FAIL_ON = 0, 1, 2, 3, 4, 5
BROKEN_PIPE = 128 + 13  # what a shell reports for a tool that SIGPIPE ended
_DEFAULT_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "regex",
    "logprobs",
    "top_logprobs",
    "max_reasoning_tokens",
    "reasoning_effort",
)


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush into the closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _redact(text: str, url: str) -> str:
    try:
        secret = urlsplit(url).password
    except ValueError:
        secret = None
    for s in {secret, unquote(secret)} if secret else ():
        text = text.replace(s, "***")
    return text


async def run(handler: Callable[..., Coroutine[Any, Any, int]], args: argparse.Namespace) -> int:
    """Open the client, run one command and map the errors a user will meet to one line each."""
    url = args.redis_url
    try:
        client = BatchqClient.from_url(url)
    except ValueError as e:
        _err(f"bad Redis URL {mask_url(url)}: {_redact(str(e), url)}")
        return INVALID
    try:
        return await handler(client, args)
    except InputError as e:
        _err(str(e))
        for le in e.errors:
            print(f"  {le}", file=sys.stderr)
        if e.bad_lines > len(e.errors):
            print(f"  ... and {e.bad_lines - len(e.errors)} more", file=sys.stderr)
        return INVALID
    except BatchNotFound as e:
        _err(str(e))
        return FAILED
    except BrokenPipeError:  # `producer list | head -2`: the reader has gone; stop quietly
        _quiet_stdout()
        return BROKEN_PIPE
    except (RedisConnectionError, RedisTimeoutError) as e:
        _err(f"cannot reach Redis at {mask_url(url)}: {_redact(str(e), url) or type(e).__name__}")
        return FAILED
    except RedisError as e:
        _err(f"Redis at {mask_url(url)} refused: {_redact(str(e), url) or type(e).__name__}")
        return FAILED
    except OSError as e:  # reading the input or writing -o FILE
        _err(f"{e.filename or ''}: {e.strerror or e}" if e.filename else str(e))
        return INVALID
    finally:
        await client.close()


def _defaults(args: argparse.Namespace) -> SamplingParams:
    values: dict[str, Any] = {
        f: getattr(args, f) for f in (*_DEFAULT_FIELDS, "timeout_s") if getattr(args, f) is not None
    }
    values.update(_labeling_defaults(args))
    if args.chat_template_kwargs is not None:
        try:
            values["chat_template_kwargs"] = orjson.loads(args.chat_template_kwargs)
        except orjson.JSONDecodeError as e:
            raise InputError(f"--chat-template-kwargs: not JSON ({e})") from None
    try:
        defaults = SamplingParams.model_validate(values)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = str(first["loc"][0]) if first["loc"] else "batch defaults"
        flag = "--timeout" if where == "timeout_s" else "--" + where.replace("_", "-")
        raise InputError(f"{flag}: {first['msg'].removeprefix('Value error, ')}") from None
    # A batch's grammar is checked once, here, naming its flag: not once per line that would take it.
    problem = grammar_problem(defaults_base(defaults))
    if problem is not None:
        flag = "--regex" if problem[0] == "regex" else f"--json-schema {args.json_schema}"
        raise InputError(f"{flag}: {problem[1]}")
    return defaults


def _labeling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """--choices / --choices-file / --json-schema as batch defaults (a file is read here, once)."""
    out: dict[str, Any] = {}
    if args.choices is not None:
        out["choices"] = [c.strip() for c in args.choices.split(",")]
    if args.choices_file is not None:
        if "choices" in out:
            raise InputError("--choices and --choices-file: give one")
        lines = Path(args.choices_file).read_text(encoding="utf-8").splitlines()
        out["choices"] = [line.strip() for line in lines if line.strip()]
    if args.json_schema is not None:
        path = Path(args.json_schema)
        try:
            schema = orjson.loads(path.read_bytes().removeprefix(b"\xef\xbb\xbf"))  # (an editor's BOM)
        except orjson.JSONDecodeError as e:
            raise InputError(
                f"--json-schema {path}: not JSON: line {e.lineno}, column {e.colno}: {e.msg}"
            ) from None
        if not isinstance(schema, dict):
            raise InputError(f"--json-schema {path}: a JSON Schema is an object")
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": path.stem[:64] or "schema", "schema": schema},
        }
    return out


def _open_out(path: str | None) -> Any:
    return open(path, "wb") if path else nullcontext(sys.stdout.buffer)


async def _write_results(
    client: BatchqClient,
    batch_id: str,
    path: str | None,
    fmt: str,
    *,
    only: str | None = None,
    errors: str | None = None,
) -> int:
    """Write results in input order; `only`: those counted as completed / failed / cancelled; `errors`: a
    file that takes the failed and cancelled ones (OpenAI's error file), the rest going to `path`."""
    n = 0
    meta = await client.batch_meta(batch_id) if fmt == "openai" else {}
    model, created = output_model_and_created(meta)
    with _open_out(path) as out, open(errors, "wb") if errors else nullcontext(out) as err_out:
        async for result, chat in client.results_with_kind(batch_id):
            if only is not None and counter_for(result.finish_reason) != only:
                continue
            if fmt == "openai":
                line = openai_line(result, chat=chat, batch_id=batch_id, model=model, created=created)
            else:
                line = result.to_user_json()
            (err_out if is_error_line(result) else out).write(line + b"\n")
            n += 1
        out.flush()
    return n


async def _wait(
    client: BatchqClient, batch_id: str, timeout: float | None, fail_on: frozenset[str] = frozenset()
) -> tuple[int, BatchStatus]:
    progress = Progress(sys.stderr)
    no_worker = NoWorkerWarning(client.redis, progress.note)

    noted = False

    async def on_progress(s: BatchStatus) -> None:
        nonlocal noted
        progress(s)
        if s.partly_enqueued and not noted:  # the wait cannot end before the submit does
            progress.note("note: " + _partly_enqueued(s))
            noted = True
        await no_worker(s)

    try:
        status = await client.wait(
            batch_id, timeout, on_progress=on_progress, poll_s=0.5 if progress.tty else 1.0
        )
    except WaitTimeout as e:
        progress.finish()
        _err(str(e))
        return TIMED_OUT, e.status
    finally:
        progress.finish()  # also on Ctrl-C or a Redis error: the terminal gets its cursor back
    return exit_code(status, fail_on), status


def exit_code(s: BatchStatus, fail_on: frozenset[str] = frozenset()) -> int:
    """SOME_FAILED when a request failed or was cancelled; else FAIL_ON when a request ended on a reason
    `fail_on` names (timeout: cut by its timeout_s; length: by max_new_tokens); else OK."""
    if s.completed != s.total:
        return SOME_FAILED
    if ("timeout" in fail_on and s.timed_out) or ("length" in fail_on and s.length):
        return FAIL_ON
    return OK


def _reasons(s: BatchStatus) -> str:
    """Every finish reason that occurred, with its count ("eos 40, repetition 2, error 1")."""
    return ", ".join(f"{reason} {n}" for reason, n in s.finish_reasons().items())


def _summary(s: BatchStatus) -> str:
    reasons = _reasons(s)
    return (
        f"batch {s.batch_id} {s.state}: {s.completed} completed, {s.failed} failed, {s.cancelled} cancelled "
        f"of {s.total}" + (f"; finish reasons: {reasons}" if reasons else "")
    )


def _resume_command(s: BatchStatus) -> str:
    """The command that finishes a partly enqueued batch's submit: the same file and options again."""
    queue = "" if s.queue in (None, keys.DEFAULT_QUEUE) else s.queue.removeprefix(keys.PREFIX + "queue:")
    return f"producer submit FILE --batch-id {s.batch_id}" + (f" --queue {queue}" if queue else "")


def _partly_enqueued(s: BatchStatus) -> str:
    return (
        f"batch {s.batch_id} is partly enqueued: {s.enqueued} of {s.total} requests are in Redis (its submit "
        f"was interrupted, or is still running); to finish it, run the same submit again (the same file and "
        f"options; nothing is enqueued twice): {_resume_command(s)}"
    )


def _applied_defaults(report: SubmitReport) -> str | None:
    """One line saying which temperature and max_new_tokens the requests that set none got (the flags'
    values, else the built-in ones: temperature 1, sampled, as OpenAI's API does, and max_new_tokens 256);
    None when every request set both."""
    applied = sorted(report.defaults_applied.items(), key=lambda kv: (kv[0][0] != "temperature", kv[0][1]))
    if not applied:
        return None
    of = f" of {report.generating} lines"
    counts = {n for _, n in applied}
    one_count = len(counts) == 1 and len({name for (name, _), _ in applied}) == len(applied)
    parts = []
    for (name, value), n in applied:
        text = f"{name} {value}"
        if name == "temperature":
            text += " (greedy)" if value == 0 else " (sampled; --temperature 0 for greedy)"
        parts.append(text if one_count else f"{text} to {n}{of}")
    return "defaults applied: " + ", ".join(parts) + (f" to {counts.pop()}{of}" if one_count else "")


def _image_limits(args: argparse.Namespace) -> ImageLimits:
    bad = [f"--{k.replace('_', '-')}" for k in ("max_image_mb", "max_image_pixels", "max_images_per_request")
           if getattr(args, k) <= 0]  # fmt: skip
    if bad:
        raise InputError(f"{', '.join(bad)}: must be greater than 0")
    return ImageLimits(int(args.max_image_mb * 2**20), args.max_image_pixels, args.max_images_per_request)


async def submit(client: BatchqClient, args: argparse.Namespace) -> int:
    defaults = _defaults(args)
    batch_id = args.batch_id or new_batch_id()
    created: list[str] = []
    try:
        report = await client.submit_file(
            args.file,
            defaults=defaults,
            batch_id=batch_id,
            queue=args.queue,
            model=args.model,
            model_aliases=dict(args.model_alias),
            skip_invalid=args.skip_invalid,
            result_ttl_s=args.result_ttl,
            result_cache=not args.no_result_cache,
            on_created=created.append,
            owner=owner_from_env(),  # $BATCHQ_API_KEY: the team whose console (`producer serve`) lists it
            image_limits=_image_limits(args),
        )
    except (asyncio.CancelledError, RedisError):
        if created:  # interrupted mid-enqueue: the same command with this id finishes it, nothing twice
            print(
                f"note: batch {batch_id} is partly enqueued; rerun with --batch-id {batch_id}",
                file=sys.stderr,
            )
        raise
    for le in report.errors:
        print(f"skipped invalid line: {le}", file=sys.stderr)
    if report.invalid > len(report.errors):
        print(f"skipped ... and {report.invalid - len(report.errors)} more invalid lines", file=sys.stderr)
    for warning in report.warnings:  # e.g. reasoning fields the queue's model ignores
        print(warning, file=sys.stderr)
    waiting = args.wait or args.output
    report_out: IO[str] = sys.stderr if waiting and not args.output else sys.stdout
    print(
        orjson.dumps(report.to_dict()).decode() if args.json else report.batch_id, file=report_out, flush=True
    )
    print(
        f"batch {report.batch_id}: {report.total} requests, {report.enqueued} enqueued now, "
        f"{report.cached} answered from the result cache, "
        f"{report.invalid} invalid",
        file=sys.stderr,
    )
    if (applied := _applied_defaults(report)) is not None:
        print(applied, file=sys.stderr)
    if not waiting:
        return OK
    code, status = await _wait(client, report.batch_id, args.wait_timeout, args.fail_on)
    if code != TIMED_OUT:
        await _write_results(client, report.batch_id, args.output, args.format, errors=args.errors)
        print(_summary(status), file=sys.stderr)
    return code


async def status(client: BatchqClient, args: argparse.Namespace) -> int:
    s = await client.status(args.batch_id)
    partly = s.partly_enqueued
    if args.json:  # `enqueued`: see BatchStatus; `resume`: the command that finishes a partly enqueued one
        extra = {"partly_enqueued": partly, "resume": _resume_command(s) if partly else None}
        print(orjson.dumps({**s.model_dump(mode="json"), **extra}).decode())
        return OK

    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

    print(f"batch      {s.batch_id}  ({s.state}{', partly enqueued' if partly else ''})")
    if partly:
        assert s.enqueued is not None
        print(
            f"requests   total {s.total}  enqueued {s.enqueued}  queued {s.in_queue}  running {s.running}  "
            f"not enqueued {s.total - s.enqueued}"
        )
        print(f"note       {_partly_enqueued(s)}")
    else:
        print(f"requests   total {s.total}  queued {s.queued}  running {s.running}")
    reasons = _reasons(s)
    print(
        f"finished   completed {s.completed}  failed {s.failed}  cancelled {s.cancelled}"
        + (f"  (retrying {s.retrying})" if s.retrying else "")
        + (f"  by finish reason: {reasons}" if reasons else "")
    )
    print(
        f"tokens     prompt {s.prompt_tokens} (prefix cache {s.cached_prompt_tokens})  "
        f"completion {s.completion_tokens}"
        + (f" (reasoning {s.reasoning_tokens})" if s.reasoning_tokens else "")
    )
    print(f"cache      {s.from_result_cache} results from the result cache")
    print(f"created    {when(s.created_at)}   finished {when(s.finished_at)}")
    return OK


async def wait(client: BatchqClient, args: argparse.Namespace) -> int:
    code, s = await _wait(client, args.batch_id, args.timeout, args.fail_on)
    if code != TIMED_OUT:
        print(_summary(s), file=sys.stderr)
    return code


async def results(client: BatchqClient, args: argparse.Namespace) -> int:
    s = await client.status(args.batch_id)
    n = await _write_results(
        client, args.batch_id, args.output, args.format, only=args.only, errors=args.errors
    )
    if n < s.total and args.only is None:
        print(f"note: {s.total - n} of {s.total} requests have no result yet", file=sys.stderr)
    return OK


async def retry(client: BatchqClient, args: argparse.Namespace) -> int:
    report = await client.retry(
        args.batch_id, failed=args.failed, cancelled=args.cancelled, timed_out=args.timed_out
    )
    if args.json:
        print(orjson.dumps(report.to_dict()).decode())
    else:
        print(
            f"batch {report.batch_id}: {report.enqueued} of {report.selected} selected requests re-enqueued; "
            f"{report.in_flight} already being retried, {report.not_retryable} not retryable "
            "(rejected at submit, or their images expired)"
        )
    return OK


async def cancel(client: BatchqClient, args: argparse.Namespace) -> int:
    n = await client.cancel(args.batch_id)
    s = await client.status(args.batch_id)
    print(
        f"batch {s.batch_id}: {n} queued requests cancelled; {s.running} running will stop at their next step"
    )
    return OK


async def list_batches(client: BatchqClient, args: argparse.Namespace) -> int:
    batches = await client.list_batches(args.limit)
    if args.json:
        for s in batches:
            print(s.model_dump_json())
        return OK
    print(f"{'BATCH':<36} {'STATE':<10} {'DONE':>15} {'FAILED':>7}  CREATED")
    for s in batches:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.created_at))
        print(f"{s.batch_id:<36} {s.state:<10} {f'{s.done}/{s.total}':>15} {s.failed:>7}  {created}")
    return OK
