"""Submitting a JSONL stream as a batch, in two passes with bounded memory.

Pass 1 validates every line and writes normalised requests to a temporary spool file, so an invalid file
enqueues nothing. Pass 2 creates the batch and enqueues from the spool in chunks, writing arq's job format
directly (arq's enqueue_job costs a round trip plus a WATCH per job: far too slow for big files).
"""

from __future__ import annotations

import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import orjson
from arq.constants import job_key_prefix, result_key_prefix
from redis.asyncio import Redis

from producer import keys
from producer.contract import ErrorInfo, Result, SamplingParams, defaults_base
from producer.jsonl import LineError, ParsedLine, parse_line, read_lines
from producer.lua import LuaScript
from producer.store import DEFAULT_RESULT_TTL_S, write_result

MAX_REPORTED = 20
CHUNK_JOBS = 2000
CHUNK_BYTES = 8 * 1024 * 1024
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
    invalid: int = 0
    body_model: str | None = None  # the first OpenAI body.model seen, recorded in the batch meta
    errors: list[LineError] = field(default_factory=list)  # the first MAX_REPORTED bad lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "total": self.total,
            "enqueued": self.enqueued,
            "invalid": self.invalid,
        }


def new_batch_id() -> str:
    return time.strftime("b-%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]


def check_batch_id(batch_id: str) -> str:
    if not _BATCH_ID.match(batch_id):
        raise InputError(f"invalid batch id {batch_id!r}: use 1-128 of A-Z a-z 0-9 . _ -")
    return batch_id


def validate_to_spool(
    stream: IO[bytes],
    spool: IO[bytes],
    report: SubmitReport,
    *,
    defaults: SamplingParams | None,
    model: str | None,
) -> None:
    """Pass 1. Spool records: b"R" + (b"c"|b"p") + 3 hex digits of queue order (see queue_order) +
    request JSON, or b"E" + error JSON; one per line."""
    seen: dict[str, int] = {}  # ids only, never prompts: memory stays small for multi-GB files
    base = defaults_base(defaults)
    index = 0
    for line_no, raw in read_lines(stream):
        if raw is not None and not raw.strip():
            continue
        parsed = parse_line(
            raw, line_no, index, batch_id=report.batch_id, defaults=defaults, model=model, base=base
        )
        if isinstance(parsed, ParsedLine):
            first = seen.setdefault(parsed.request.id, line_no)
            if first != line_no:
                parsed = [
                    LineError(line_no, "id", f"duplicate id {parsed.request.id!r} (first on line {first})")
                ]
        if isinstance(parsed, ParsedLine):
            report.body_model = report.body_model or parsed.body_model
            body = orjson.dumps(parsed.request.model_dump(mode="json", exclude={"enqueued_at"}))
            order = b"%03x" % queue_order(parsed.request.params.max_new_tokens)
            spool.write(b"R" + (b"c" if parsed.chat else b"p") + order + body + b"\n")
        else:
            report.invalid += 1
            if len(report.errors) < MAX_REPORTED:
                report.errors.extend(parsed[:1] if len(parsed) == 1 else [_join(parsed)])
            uid = parsed[0].id or str(line_no)
            spool.write(b"E" + orjson.dumps({"id": uid, "reason": "; ".join(map(str, parsed))}) + b"\n")
        index += 1
    report.total = index


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


# KEYS: meta, batches index. ARGV: total, created_at, batch id, then field/value pairs. Creates the batch
# once; returns the total already recorded when the batch exists (a resubmission), or 0 when it created it.
_CREATE = LuaScript("""
local existing = redis.call('HGET', KEYS[1], 'total')
if existing then return tonumber(existing) end
redis.call('HSET', KEYS[1], 'total', ARGV[1], 'created_at', ARGV[2], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 0
""")

# KEYS: queue, results hash, chat bitmap. ARGV: (index, job id, chat flag, payload, score) per job.
# A job is skipped when its result exists, arq kept its result, or its job key exists (SET NX).
_ENQUEUE = LuaScript(
    """
local n = 0
for i = 1, #ARGV, 5 do
  local idx, jid = ARGV[i], ARGV[i + 1]
  if ARGV[i + 2] == '1' then redis.call('SETBIT', KEYS[3], idx, 1) end
  if redis.call('HEXISTS', KEYS[2], idx) == 0 and redis.call('EXISTS', '"""
    + result_key_prefix
    + """' .. jid) == 0
     and redis.call('SET', '"""
    + job_key_prefix
    + """' .. jid, ARGV[i + 3], 'NX') then
    redis.call('ZADD', KEYS[1], ARGV[i + 4], jid)
    n = n + 1
  end
end
return n
"""
)


async def create_batch(
    redis: Redis,
    report: SubmitReport,
    *,
    queue: str,
    model: str | None,
    defaults: SamplingParams | None,
    result_ttl_s: int,
) -> None:
    fields: dict[str, Any] = {
        "queue": queue,
        "model": model or "",
        "body_model": report.body_model or "",
        "defaults": orjson.dumps(defaults.model_dump(mode="json", exclude_none=True) if defaults else {}),
        "result_ttl_s": result_ttl_s,
        "completed": 0,
        "failed": 0,
        "cancelled": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
    }
    flat = [x for kv in fields.items() for x in kv]
    existing = await _CREATE(
        redis,
        [keys.batch_meta(report.batch_id), keys.BATCHES],
        [report.total, repr(time.time()), report.batch_id, *flat],
    )
    if existing and int(existing) != report.total:
        raise InputError(
            f"batch {report.batch_id!r} already exists with {int(existing)} requests, this input has "
            f"{report.total}: use another --batch-id"
        )


def _spool_records(spool: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    spool.seek(0)
    for index, rec in enumerate(spool):
        yield index, rec.rstrip(b"\n")


async def enqueue_spool(redis: Redis, spool: IO[bytes], report: SubmitReport, *, queue: str) -> None:
    """Pass 2: enqueue valid requests and record invalid ones as failed results."""
    bid = report.batch_id
    now = time.time()
    et = str(int(now * 1000)).encode()
    head = b'{"t":null,"f":"' + keys.JOB_FUNCTION.encode() + b'","a":['
    tail = b'],"k":{},"et":' + et + b"}"
    enq_at = b',"enqueued_at":' + repr(now).encode() + b"}"
    ks = [queue, keys.batch_results(bid), keys.batch_chat(bid)]
    et_ms = int(et)
    scores = [repr(et_ms + level / ORDER_LEVELS).encode() for level in range(ORDER_LEVELS)]
    args: list[Any] = []
    size = 0
    for index, rec in _spool_records(spool):
        if rec[:1] == b"E":
            err = orjson.loads(rec[1:])
            result = Result(
                id=err["id"],
                index=index,
                finish_reason="error",
                error=ErrorInfo(type="invalid_request", message=err["reason"]),
            )
            await write_result(redis, bid, result)
            continue
        # Request JSON was spooled without enqueued_at; append it now so queued_s starts at enqueue time.
        payload = head + rec[5:-1] + enq_at + tail
        chat = 1 if rec[1:2] == b"c" else 0
        args += [index, keys.job_id(bid, index), chat, payload, scores[int(rec[2:5], 16)]]
        size += len(payload)
        if len(args) >= 5 * CHUNK_JOBS or size >= CHUNK_BYTES:
            report.enqueued += int(await _ENQUEUE(redis, ks, args))
            args, size = [], 0
    if args:
        report.enqueued += int(await _ENQUEUE(redis, ks, args))


async def submit_stream(
    redis: Redis,
    stream: IO[bytes],
    *,
    batch_id: str | None = None,
    queue: str | None = None,
    model: str | None = None,
    defaults: SamplingParams | None = None,
    skip_invalid: bool = False,
    result_ttl_s: int = DEFAULT_RESULT_TTL_S,
    on_created: Callable[[str], None] | None = None,
) -> SubmitReport:
    """Validate all of `stream`, then enqueue it as one batch. Raises InputError before enqueuing anything.

    `on_created(batch_id)` is called once the batch exists, before its jobs are enqueued: from then on an
    interrupted submit is finished by submitting again with the same batch id.
    """
    report = SubmitReport(batch_id=check_batch_id(batch_id) if batch_id else new_batch_id())
    qname = keys.queue_name(queue)
    with tempfile.TemporaryFile(prefix="batchq-spool-") as spool:
        validate_to_spool(stream, spool, report, defaults=defaults, model=model)
        if report.total == 0:
            raise InputError("input is empty: no request lines")
        if report.invalid and not skip_invalid:
            raise InputError(
                f"{report.invalid} invalid line(s); nothing was enqueued", report.errors, report.invalid
            )
        await create_batch(
            redis, report, queue=qname, model=model, defaults=defaults, result_ttl_s=result_ttl_s
        )
        await enqueue_spool(redis, spool, report, queue=qname)
    return report
