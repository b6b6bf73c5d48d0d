"""Pass 1 of a submit: validate every line of a JSONL stream into a spool file, so an invalid file enqueues
nothing (producer/client/submit.py runs the two passes; enqueue.py is pass 2).

A spooled request carries what pass 2 needs without parsing it again: its kind, its queue order, and its
result-cache key when its output is determined. The report records each request's content digest and
input line, so a resubmission under the same batch id can be checked against what the batch holds.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from producer.client.grammars import grammar_problem
from producer.client.images import ImageChecks
from producer.client.jsonl import LineError, ParsedLine, parse_line, read_lines
from producer.client.live_workers import sets_reasoning
from producer.wire.request_params import SamplingParams, defaults_base
from producer.wire.result_cache import request_key
from producer.wire.workers import QueueServing

MAX_REPORTED = 20
DIGEST_BYTES = 8  # a request's content digest: locates the first differing line of a resubmission
NO_KEY = b"-" * 64  # a spool record without a result-cache key
JSON_AT = 5 + len(NO_KEY)  # where a spooled request's JSON starts
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
    images: ImageChecks = field(default_factory=ImageChecks)  # and where a request's images are kept


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
            elif problems := _problems(parsed, serving, checks.images):
                parsed = problems
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
                    and "lora" not in rec  # an adapter's answers are keyed by its digest, at the worker
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


def _problems(parsed: ParsedLine, serving: QueueServing | None, images: ImageChecks) -> list[LineError]:
    """Why a valid line still cannot run (see _check_request); a line with images has them checked, and
    its record rewritten to refer to them, once nothing else is wrong with it."""
    rec = parsed.record
    problem = _check_request(rec, serving)
    if problem is not None:
        return [LineError(parsed.line_no, parsed.fields_at + problem[0], problem[1], rec["id"])]
    return images.take(rec, parsed.line_no, parsed.fields_at) if parsed.images else []


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
