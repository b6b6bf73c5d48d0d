"""Submitting a JSONL stream as a batch, in two passes with bounded memory.

Pass 1 validates every line and writes normalised requests to a temporary spool file, so an invalid file
enqueues nothing; a request whose output is determined gets its result-cache key there. Pass 2 creates
the batch and goes through the spool in chunks: it answers the requests whose answer the result cache
holds (producer/wire/result_cache.py) at once and enqueues the rest, writing arq's job format directly (arq's
enqueue_job costs a round trip plus a WATCH per job: far too slow for big files).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import orjson
from arq.constants import job_key_prefix, result_key_prefix
from redis.asyncio import Redis

from producer.client.grammars import grammar_problem
from producer.client.jsonl import LineError, ParsedLine, parse_line, read_lines
from producer.client.live_workers import (
    ignores_reasoning,
    live_workers,
    queue_serving,
    reasoning_ignored,
    sets_reasoning,
)
from producer.wire import keys
from producer.wire.contract import ErrorInfo, Result, SamplingParams, Timing, defaults_base
from producer.wire.lua import LuaScript, done
from producer.wire.result_cache import CachedAnswer, request_key
from producer.wire.store import ENQUEUED, EXCERPTS_PER_FIELD, write_result
from producer.wire.workers import QueueServing

MAX_REPORTED = 20
DIGEST_BYTES = 8  # a request's content digest: locates the first differing line of a resubmission
NO_KEY = b"-" * 64  # a spool record without a result-cache key
JSON_AT = 5 + len(NO_KEY)  # where a spooled request's JSON starts
CHUNK_JOBS = 2000
CHUNK_BYTES = 8 * 1024 * 1024
EXCERPT_CHARS = 200  # of each request's input, kept for the console's rows to review (keys.batch_inputs)
_BATCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InputError(ValueError):
    """The input cannot be submitted (missing, empty or invalid lines); nothing was enqueued."""

    def __init__(self, message: str, errors: list[LineError] | None = None, bad_lines: int = 0) -> None:
        super().__init__(message)
        self.errors = errors or []
        self.bad_lines = bad_lines


@dataclass
class SubmitReport:
    batch_id: str
    total: int = 0
    enqueued: int = 0
    cached: int = 0  # answered from the result cache at submit, never enqueued
    invalid: int = 0
    body_model: str | None = None  # the first OpenAI body.model seen (as written), recorded in the batch meta
    model: str | None = None  # the first model a request names (after --model-alias)
    errors: list[LineError] = field(default_factory=list)  # the first MAX_REPORTED bad lines
    digests: bytearray = field(default_factory=bytearray)  # DIGEST_BYTES per request, in index order
    line_numbers: array[int] = field(default_factory=lambda: array("I"))  # each request's input line
    reasoning_ignored: int = 0  # chat requests with reasoning fields the queue's live model ignores
    warnings: list[str] = field(default_factory=list)  # once per batch, for the user (the CLI: on stderr)
    generating: int = 0  # valid requests that generate text (embedding requests do not)
    # (field, the value in force) -> how many generating requests left the field (jsonl.REPORTED_DEFAULTS)
    # to a default: the batch's, the contract's (BUILTIN_DEFAULTS, a choices line's CHOICES_TEMPERATURE)
    # or the engine's (ENGINE_TEMPERATURE)
    defaults_applied: dict[tuple[str, Any], int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "total": self.total,
            "enqueued": self.enqueued,
            "cached": self.cached,
            "invalid": self.invalid,
        }


# The temperature a request that sets none (nor its batch) samples at: the engine's default
# (worker/engine/params.py, GenerationParams.temperature; OpenAI's too). The producer cannot import it.
ENGINE_TEMPERATURE = 1.0


def new_batch_id() -> str:
    return time.strftime("b-%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]


def check_batch_id(batch_id: str) -> str:
    if not _BATCH_ID.match(batch_id):
        raise InputError(f"invalid batch id {batch_id!r}: use 1-128 of A-Z a-z 0-9 . _ -")
    return batch_id


@dataclass
class SubmitChecks:
    """What pass 1 checks lines against, besides the contract: what serves the queue, if a worker ever
    said (the context length a request's max_new_tokens must fit), and the result-cache lookups it may
    make. A request is looked up only when it names no model, or names the model a live worker of the
    queue serves (`live_model`): a cached answer never answers a request for another model."""

    serving: QueueServing | None = None
    fingerprint: str | None = None  # the result cache's, None: no lookups
    live_model: str | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    ignores_reasoning: bool = False  # live_model has no reasoning markers (live_workers.ignores_reasoning)


def validate_to_spool(
    stream: IO[bytes],
    spool: IO[bytes],
    report: SubmitReport,
    *,
    defaults: SamplingParams | None,
    model: str | None,
    fingerprint: str | None = None,
    result_cache: bool = True,
    checks: SubmitChecks | None = None,
) -> None:
    """Pass 1. Spool records: b"R" + (b"c"|b"p"|b"e": chat, prompt, embeddings) + 3 hex digits of queue order (see queue_order) + the
    64 hex digits of its result-cache key (NO_KEY when it has none) + request JSON, or b"E" + error
    JSON; one per line. `fingerprint` (or `checks.fingerprint`): the queue's workers' (None: no lookups).
    Also records each request's content digest and line number in `report` (see create_batch)."""
    checks = checks or SubmitChecks(fingerprint=fingerprint)
    fingerprint = checks.fingerprint
    serving = checks.serving
    seen: dict[str, int] = {}  # id -> line (negative: an id given for lack of one); never prompts
    base = defaults_base(defaults)
    batch_id, write, dumps = report.batch_id, spool.write, orjson.dumps
    digests, lines = report.digests, report.line_numbers
    index = 0
    for line_no, raw in read_lines(stream):
        if raw is not None and raw.isspace():  # blank (isspace, unlike strip, copies nothing)
            continue
        parsed = parse_line(
            raw, line_no, index, batch_id=batch_id, defaults=defaults, model=model, base=base,
            aliases=checks.aliases,
        )  # fmt: skip
        if isinstance(parsed, ParsedLine):
            rec = parsed.record
            rid = rec["id"]
            first = seen.setdefault(rid, line_no if rid != str(line_no) or _has_id(raw) else -line_no)
            if abs(first) != line_no:
                parsed = [LineError(line_no, "id", _duplicate(rid, line_no, first, raw))]
            elif (problem := _check_request(rec, serving)) is not None:
                parsed = [LineError(line_no, parsed.fields_at + problem[0], problem[1], rid)]
            else:
                if parsed.body_model and not report.body_model:
                    report.body_model = parsed.body_model
                if rec["model"] and not report.model:
                    report.model = rec["model"]
                body = dumps(rec)
                digests.extend(_digest(body))
                if not result_cache:
                    body = body[:-1] + b',"result_cache":false}'
                key = None
                # embeddings are not result-cached (a cached answer holds text, not vectors)
                if (
                    fingerprint is not None
                    and rec["model"] in (None, checks.live_model)
                    and not parsed.embedding
                ):
                    key = request_key(fingerprint, rec["prompt"], rec["messages"], rec["params"])
                if not parsed.embedding:
                    _count_defaults(report, parsed)
                if checks.ignores_reasoning and parsed.chat and rec["model"] in (None, checks.live_model):
                    report.reasoning_ignored += sets_reasoning(rec["params"])
                kind = b"Re" if parsed.embedding else b"Rc" if parsed.chat else b"Rp"
                order = b"%03x" % queue_order(rec["params"]["max_new_tokens"])
                digest = NO_KEY if key is None else key.rpartition(":")[2].encode()
                write(kind + order + digest + body + b"\n")
                lines.append(line_no)
                index += 1
                continue
        report.invalid += 1
        if len(report.errors) < MAX_REPORTED:
            report.errors.extend(parsed[:1] if len(parsed) == 1 else [_join(parsed)])
        uid = parsed[0].id or str(line_no)
        err = dumps({"id": uid, "reason": "; ".join(map(str, parsed))})
        digests.extend(_digest(err))
        write(b"E" + err + b"\n")
        lines.append(line_no)
        index += 1
    report.total = index


def _count_defaults(report: SubmitReport, parsed: ParsedLine) -> None:
    """Count a generating request, and the values its unset REPORTED_DEFAULTS took (max_new_tokens is
    always resolved; a temperature the params lack is the engine's)."""
    report.generating += 1
    applied = report.defaults_applied
    for k in parsed.unset:
        key = (k, parsed.record["params"].get(k, ENGINE_TEMPERATURE))
        applied[key] = applied.get(key, 0) + 1


def _digest(record: bytes) -> bytes:
    return hashlib.blake2b(record, digest_size=DIGEST_BYTES).digest()


def _has_id(raw: bytes | None) -> bool:
    """Whether the line wrote an id of its own (else parse_line gave it its line number)."""
    return raw is not None and (b'"id"' in raw or b'"custom_id"' in raw)


def _duplicate(rid: str, line_no: int, first: int, raw: bytes | None) -> str:
    """The duplicate-id message, saying which of the two ids was given for lack of one (a line without an
    id gets its line number as id: docs/architecture.md, "Input")."""
    where = f"first on line {abs(first)}"
    if first < 0:
        where += f", where it is the id given to line {-first}, which has none of its own"
    if not _has_id(raw):
        return f"duplicate id {rid!r} (the id given to line {line_no}, which has none of its own; {where})"
    return f"duplicate id {rid!r} ({where})"


def _check_request(rec: dict[str, Any], serving: QueueServing | None) -> tuple[str, str] | None:
    """(field, reason) when a valid line still cannot run: its grammar does not compile, or it asks for
    more new tokens than the model the queue serves can ever hold."""
    params = rec["params"]
    emb = rec.get("embedding")
    if emb is not None:
        size, dims = serving.embedding_size if serving is not None else None, emb["dimensions"]
        if serving is not None and rec["model"] in (None, serving.model) and size and dims and dims > size:
            return (
                "dimensions",
                f"{dims} dimensions asked, but the model {serving.model!r} serving this queue embeds in {size}",
            )
        return None
    if serving is not None and rec["model"] in (None, serving.model):
        asked, context = params["max_new_tokens"], serving.max_model_len
        if asked > context:
            return (
                "max_new_tokens",
                f"{asked} new tokens asked, but the model {serving.model!r} serving this queue holds "
                f"{context} tokens in all (prompt and output together)",
            )
    return grammar_problem(params)


ORDER_LEVELS = 4096  # distinct fractions of a millisecond a queue score can hold at today's epoch-ms
ORDER_TOKENS_PER_LEVEL = 8


def queue_order(max_new_tokens: int | None) -> int:
    """Position of a request within its batch's millisecond of queue score: longest generations first.

    Workers pull in score order. A batch is done when its last request is, so long generations must
    not be pulled last, where they would decode alone at a small batch size: the queue hands them out
    first and the short labeling requests fill the slots they leave (longest-processing-time-first).
    Every request of a batch still scores within the same millisecond, so batches stay in FIFO order.
    """
    n = max_new_tokens if max_new_tokens is not None else 0
    return max(0, ORDER_LEVELS - 1 - n // ORDER_TOKENS_PER_LEVEL)


def _join(errors: list[LineError]) -> LineError:
    first = errors[0]
    rest = "; ".join(f"{e.field}: {e.reason}" if e.field else e.reason for e in errors[1:])
    return LineError(first.line_no, first.field, f"{first.reason}; {rest}", first.id)


# The scripts, in producer/wire/lua/ (each file's head gives its KEYS and ARGV).
_CREATE = LuaScript.load("create_batch.lua")
_ENQUEUE = LuaScript.load(
    "enqueue.lua", JOB_KEY=job_key_prefix, RESULT_KEY=result_key_prefix, ENQUEUED=ENQUEUED,
    ORDER_LEVELS=ORDER_LEVELS,
)  # fmt: skip
_ADD_ENQUEUED = LuaScript.load("add_enqueued.lua", ENQUEUED=ENQUEUED)
_CLAIM_MS = LuaScript.load("claim_ms.lua")  # a submit's enqueue millisecond: see the file


async def create_batch(
    redis: Redis,
    report: SubmitReport,
    *,
    queue: str,
    model: str | None,
    defaults: SamplingParams | None,
    result_ttl_s: int,
    owner: str | None = None,
) -> bool:
    """Create the batch, or check a resubmission against it: the same content again is a no-op (an
    interrupted submit finishes), other content under the same id is refused, naming the first line that
    differs. True when this call created it."""
    fields: dict[str, Any] = {
        "queue": queue,
        "model": report.model or model or "",
        "body_model": report.body_model or "",
        "defaults": orjson.dumps(defaults.model_dump(mode="json", exclude_none=True) if defaults else {}),
        "result_ttl_s": result_ttl_s,
        "completed": 0,
        "failed": 0,
        "cancelled": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        ENQUEUED: 0,  # until enqueue_spool has put every request into Redis (BatchStatus.enqueued)
    }
    if owner:
        fields["owner"] = owner
    flat = [x for kv in fields.items() for x in kv]
    blob = bytes(report.digests)
    digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
    bid = report.batch_id
    existing = await _CREATE(
        redis,
        [keys.batch_meta(bid), keys.BATCHES, keys.batch_digests(bid)],
        [report.total, repr(time.time()), bid, digest, blob, *flat],
    )
    if not int(existing[0]):
        return True
    total, stored = int(existing[0]), _s(existing[1])
    if stored and stored != digest:
        raise InputError(await _differs(redis, report, total))
    if total != report.total:  # a batch created before batches kept a digest
        raise InputError(
            f"batch {bid!r} already exists with {total} requests, this input has {report.total}: "
            "use another --batch-id"
        )
    return False


async def _differs(redis: Redis, report: SubmitReport, total: int) -> str:
    """The refusal of other content under an existing batch id, naming the first request that differs."""
    theirs = await done(redis.get(keys.batch_digests(report.batch_id))) or b""
    mine = bytes(report.digests)
    n, common = DIGEST_BYTES, min(total, report.total)
    first = next(
        (i for i in range(common) if mine[i * n : (i + 1) * n] != theirs[i * n : (i + 1) * n]), common
    )
    if first < common:
        where = f"line {report.line_numbers[first]} (request {first + 1}) differs from what it holds"
    else:
        where = f"it holds {total} requests, this input {report.total}"
    return (
        f"batch {report.batch_id!r} already exists with other content: {where}. The same content again "
        "is a no-op (that finishes an interrupted submit); use another --batch-id for new content"
    )


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _spool_records(spool: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    spool.seek(0)
    for index, rec in enumerate(spool):
        yield index, rec.rstrip(b"\n")


class _Chunk:
    """Consecutive valid records, sent as one _ENQUEUE call."""

    __slots__ = ("first", "kinds", "orders", "payloads", "size")

    def __init__(self, first: int) -> None:
        self.first = first
        self.kinds: list[bytes] = []
        self.orders: list[bytes] = []
        self.payloads: list[bytes] = []
        self.size = 0

    def add(self, rec: bytes, payload: bytes) -> bool:
        """Add a spooled request as its job payload; True when the chunk is full."""
        self.kinds.append(rec[1:2])
        self.orders.append(rec[2:5])
        self.payloads.append(payload)
        self.size += len(payload)
        return len(self.payloads) >= CHUNK_JOBS or self.size >= CHUNK_BYTES

    def args(self, prefix: bytes, et: bytes, fresh: bool) -> list[bytes | int]:
        kinds, orders = b"".join(self.kinds), b"".join(self.orders)
        return [prefix, self.first, et, kinds, orders, int(fresh), *self.payloads]


def _groups(records: Iterator[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    group: list[tuple[int, bytes]] = []
    for item in records:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


async def _cached_answers(redis: Redis, group: list[tuple[int, bytes]]) -> dict[int, CachedAnswer]:
    """The result cache's answers for the group's keyed requests, in one round trip."""
    keyed = [(i, rec[5:JSON_AT]) for i, rec in group if rec[:1] == b"R" and rec[5:JSON_AT] != NO_KEY]
    if not keyed:
        return {}
    raws = await done(redis.mget([keys.result_cache(d.decode()) for _, d in keyed]))
    return {
        i: CachedAnswer.from_json(raw) for (i, _), raw in zip(keyed, raws, strict=True) if raw is not None
    }


async def _answer(
    redis: Redis, batch_id: str, group: list[tuple[int, bytes]], answers: dict[int, CachedAnswer]
) -> int:
    """Store the cached answers as the group's results (never enqueued); returns how many were stored."""
    chat = keys.batch_chat(batch_id)
    writes = []
    async with redis.pipeline(transaction=False) as pipe:
        for index, rec in group:
            answer = answers.get(index)
            if answer is None:
                continue
            req = orjson.loads(rec[JSON_AT:])
            result = answer.result(req["id"], index, req.get("metadata"), timing=Timing(), worker=None)
            writes.append(write_result(redis, batch_id, result))
            if rec[1:2] == b"c":
                pipe.setbit(chat, index, 1)  # the OpenAI output needs to know it was a chat request
        await pipe.execute()
    return sum(await asyncio.gather(*writes))


def excerpt(req: dict[str, Any]) -> str:
    """What a person reviewing a row reads first: the prompt, or the last user message (else the last
    message), whitespace runs made one space; a longer one keeps its head and its tail around an ellipsis,
    EXCERPT_CHARS in all, since rows that share a long instruction differ in their tail (the item)."""
    text = req.get("prompt")
    if text is None:
        messages = req.get("messages") or [{}]
        users = [m for m in messages if m.get("role") == "user"]
        text = (users or messages)[-1].get("content") or ""
    raw = str(text)
    if len(raw) > 8 * EXCERPT_CHARS:  # a prompt may be long: its ends are enough
        raw = raw[: 4 * EXCERPT_CHARS] + " " + raw[-4 * EXCERPT_CHARS :]
    text = " ".join(raw.split())
    if len(text) <= EXCERPT_CHARS:
        return text
    head = EXCERPT_CHARS // 2 - 1
    return text[:head] + "\u2026" + text[len(text) - (EXCERPT_CHARS - head - 1) :]


assert CHUNK_JOBS % EXCERPTS_PER_FIELD == 0  # a group of CHUNK_JOBS records fills whole fields


async def _store_excerpts(redis: Redis, batch_id: str, group: list[tuple[int, bytes]]) -> None:
    """The group's excerpts, EXCERPTS_PER_FIELD a field (store.get_excerpts): a few arguments per group,
    where one a request would cost submit a tenth of its speed in redis-py's packing."""
    fields = {}
    for start in range(0, len(group), EXCERPTS_PER_FIELD):
        part = group[start : start + EXCERPTS_PER_FIELD]
        texts = [excerpt(orjson.loads(rec[JSON_AT:])) if rec[:1] == b"R" else None for _, rec in part]
        fields[part[0][0] // EXCERPTS_PER_FIELD] = orjson.dumps(texts)
    if fields:
        await done(redis.hset(keys.batch_inputs(batch_id), mapping=fields))


def _invalid(rid: str, index: int, reason: str) -> Result:
    return Result(
        id=rid, index=index, finish_reason="error", error=ErrorInfo(type="invalid_request", message=reason)
    )


async def _add_enqueued(redis: Redis, meta: str, n: int) -> int:
    """Count `n` results submit wrote in an unfinished submit's store.ENQUEUED; 0, the count left to add."""
    if n:
        await _ADD_ENQUEUED(redis, [meta], [n])
    return 0


async def enqueue_spool(
    redis: Redis, spool: IO[bytes], report: SubmitReport, *, queue: str, fresh: bool = False
) -> None:
    """Pass 2: enqueue valid requests, answer the ones the result cache holds, record invalid ones as
    failed results.

    `fresh`: create_batch created the batch just now (not a resubmission), so no job of it can exist yet.

    One chunk is in flight while the next is built: Redis runs the script on one core while Python
    reads and frames the next chunk on the other.

    Progress is recorded for `producer status`: the meta's store.ENQUEUED (set to 0 by create_batch) counts
    the requests this submit (or an interrupted one before it) put into Redis: jobs as their chunk's
    script writes them, results of invalid lines and cache hits at the end of each group. Once every
    request is in, the field is deleted: a batch without it is wholly enqueued.
    """
    bid = report.batch_id
    now = time.time()
    et = str(await _CLAIM_MS(redis, [keys.queue_clock(queue)], [])).encode()
    head = b'{"t":null,"f":"' + keys.JOB_FUNCTION.encode() + b'","a":['
    tail = b'],"k":{},"et":' + et + b"}"
    # Request JSON was spooled without enqueued_at; append it now so queued_s starts at enqueue time.
    enq_at = b',"enqueued_at":' + repr(now).encode() + b"}"
    meta = keys.batch_meta(bid)
    ks = [queue, keys.batch_results(bid), keys.batch_chat(bid), meta]
    prefix = keys.job_id_prefix(bid).encode()
    in_flight: asyncio.Task[Any] | None = None
    answered = 0  # results written since progress was last recorded (invalid lines, cache hits)

    async def send(chunk: _Chunk) -> None:
        nonlocal in_flight
        if in_flight is not None:
            report.enqueued += int(await in_flight)
        in_flight = asyncio.ensure_future(_ENQUEUE(redis, ks, chunk.args(prefix, et, fresh)))
        await asyncio.sleep(0)  # let it pack and send the call now, not once the next chunk is built

    chunk: _Chunk | None = None
    try:
        for group in _groups(_spool_records(spool), CHUNK_JOBS):
            # Before the group's jobs exist, so the batch cannot finish (and expire its keys) before them.
            await _store_excerpts(redis, bid, group)
            answers = await _cached_answers(redis, group)
            for index, rec in group:
                if rec[:1] == b"E" or index in answers:
                    if chunk is not None:
                        await send(chunk)
                        chunk = None
                    if rec[:1] == b"E":
                        err = orjson.loads(rec[1:])
                        answered += await write_result(redis, bid, _invalid(err["id"], index, err["reason"]))
                    continue
                chunk = chunk or _Chunk(index)
                if chunk.add(rec, head + rec[JSON_AT:-1] + enq_at + tail):
                    await send(chunk)
                    chunk = None
            if answers:
                cached = await _answer(redis, bid, group, answers)
                report.cached += cached
                answered += cached
            answered = await _add_enqueued(redis, meta, answered)
        if chunk is not None:
            await send(chunk)
        if in_flight is not None:
            report.enqueued += int(await in_flight)
            in_flight = None
        await done(redis.hdel(meta, ENQUEUED))  # every request is in Redis: the submit is finished
    finally:
        if in_flight is not None:  # an error above: don't leave the call running unobserved
            in_flight.cancel()


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
    """
    report = SubmitReport(batch_id=check_batch_id(batch_id) if batch_id else new_batch_id())
    qname = keys.queue_name(queue)
    aliases = dict(model_aliases or {})
    model = aliases.get(model, model) if model else None
    checks = await submit_checks(redis, qname, result_cache=result_cache, aliases=aliases)
    with tempfile.TemporaryFile(prefix="batchq-spool-") as spool:
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
        await enqueue_spool(redis, spool, report, queue=qname, fresh=fresh)
    return report


async def submit_checks(
    redis: Redis, queue: str, *, result_cache: bool, aliases: Mapping[str, str]
) -> SubmitChecks:
    """What serves `queue` (as its workers last published it) and whether a live worker serves it now."""
    serving = await queue_serving(redis, queue)
    if serving is None:
        return SubmitChecks(aliases=aliases)
    live = any(w.model == serving.model for w in await live_workers(redis, queue))
    return SubmitChecks(
        serving=serving,
        fingerprint=serving.fingerprint if result_cache and serving.result_cache else None,
        live_model=serving.model if live else None,
        aliases=aliases,
        ignores_reasoning=live and ignores_reasoning(serving),
    )
