"""Pass 2 of a submit: create the batch, then go through the spool pass 1 wrote (validate.py) in chunks.

Requests whose answer the result cache holds (producer/wire/result_cache.py) are answered at once; the rest
are enqueued by a Lua script that writes arq's job format directly (arq's enqueue_job costs a round trip
plus a WATCH per job: far too slow for big files). Invalid lines are recorded as failed results.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from typing import IO, Any

import orjson
from arq.constants import job_key_prefix, result_key_prefix
from redis.asyncio import Redis

from producer.client.validate import DIGEST_BYTES, JSON_AT, NO_KEY, ORDER_LEVELS, InputError, SubmitReport
from producer.wire import keys
from producer.wire.lua import LuaScript, done
from producer.wire.request_params import SamplingParams
from producer.wire.result_cache import CachedAnswer
from producer.wire.results import ErrorInfo, Result, Timing
from producer.wire.store import ENQUEUED, EXCERPTS_PER_FIELD, write_result

CHUNK_JOBS = 2000
CHUNK_BYTES = 8 * 1024 * 1024
EXCERPT_CHARS = 200  # of each request's input, kept for the console's rows to review (keys.batch_inputs)

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
        if isinstance(text, list):  # text parts, or a message with images: its text, each image a mark
            text = " ".join(p["text"] if p.get("type") == "text" else "[image]" for p in text)
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
