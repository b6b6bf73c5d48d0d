"""An API batch: the create request, the record stored in Redis (keys.api_batch), and OpenAI's Batch object."""

from __future__ import annotations

import hmac
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

import orjson

from producer.api.common import ApiError
from producer.api.files import INPUT_PURPOSE, FileRecord
from producer.client.submit import InputError
from producer.wire import keys
from producer.wire.input_lines import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL
from producer.wire.results import BatchStatus

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
_WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_H = 720
MAX_METADATA = 16
MIN_FILE_TTL_S, MAX_FILE_TTL_S = 3600, keys.DEFAULT_FILE_TTL_S  # OpenAI's bounds of expires_after
_CREATE_FIELDS = frozenset(
    {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
)


@dataclass(frozen=True)
class CreateRequest:
    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: int
    metadata: dict[str, str] | None
    output_ttl_s: int  # of the output and error files (output_expires_after)

    @classmethod
    def parse(cls, body: Any) -> CreateRequest:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        unknown = sorted(body.keys() - _CREATE_FIELDS)
        if unknown:
            raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise ApiError(400, f"'{name}' is required (a string)", param=name)
        endpoint, window = body["endpoint"], body["completion_window"]
        if endpoint not in ENDPOINTS:
            raise ApiError(
                400,
                f"endpoint {endpoint!r} is unsupported: batchq runs {', '.join(ENDPOINTS)}",
                param="endpoint",
            )
        m = _WINDOW.match(window)
        if m is None or int(m[1]) > MAX_WINDOW_H:
            raise ApiError(
                400, f"completion_window must be '24h' (or 1h-{MAX_WINDOW_H}h)", param="completion_window"
            )
        return cls(
            body["input_file_id"],
            endpoint,
            window,
            int(m[1]) * 3600,
            _metadata(body.get("metadata")),
            expires_after(body.get("output_expires_after"), "output_expires_after"),
        )


def expires_after(value: Any, param: str) -> int:
    """The TTL in seconds that OpenAI's `{"anchor": "created_at", "seconds": N}` asks for (None: default)."""
    if value is None:
        return keys.DEFAULT_FILE_TTL_S
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("anchor") != "created_at"
        or not isinstance(seconds, int)
        or not MIN_FILE_TTL_S <= seconds <= MAX_FILE_TTL_S
    ):
        raise ApiError(
            400, f"{param}: anchor 'created_at' and seconds {MIN_FILE_TTL_S}-{MAX_FILE_TTL_S}", param=param
        )
    return seconds


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's rule: up to 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA
    ok = ok and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in value.items())  # fmt: skip
    if not ok:
        raise ApiError(
            400, "metadata: up to 16 string pairs, keys <= 64 and values <= 512 chars", param="metadata"
        )
    return dict(value)


def check_endpoint(endpoint: str, f: FileRecord) -> None:
    if f.purpose != INPUT_PURPOSE:
        raise ApiError(400, f"file {f.id} has purpose {f.purpose!r}, not 'batch'", param="input_file_id")
    by_kind = {
        CHAT_URL: f.chat_requests,
        EMBEDDINGS_URL: f.embedding_requests,
        COMPLETIONS_URL: f.requests - f.chat_requests - f.embedding_requests,
    }
    wrong = [f"{n} {url}" for url, n in by_kind.items() if url != endpoint and n]
    if wrong:
        raise ApiError(
            400,
            f"file {f.id} holds {' and '.join(wrong)} request(s); a batch runs one endpoint ({endpoint})",
            param="endpoint",
        )


_TIMES = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")  # fmt: skip


@dataclass
class BatchRecord:
    """The hash's fields. Timestamps are unix seconds, 0 for "not yet"; "" is an unset string."""

    id: str
    owner: str  # auth.owner_id of the key that created it
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int  # the input file's request count; the batchq batch's total once it has one
    metadata: str = ""  # JSON
    output_ttl_s: int = 0  # of the output and error files; 0: keys.DEFAULT_FILE_TTL_S
    model: str = ""
    status: str = ""  # set once the batch has ended (or failed): from then on the hash is the whole truth
    in_progress_at: int = 0  # every line was enqueued (the submit finished)
    cancelling_at: int = 0
    expiring_at: int = 0  # the window passed while requests were left; they were cancelled
    finalizing_at: int = 0
    completed_at: int = 0
    failed_at: int = 0
    expired_at: int = 0
    cancelled_at: int = 0
    errors: str = ""  # JSON: OpenAI's errors list of a failed batch
    output_file_id: str = ""
    error_file_id: str = ""
    completed: int = 0  # final counts and usage, recorded when it ended
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def to_hash(self) -> dict[str, str | int]:
        """The fields that are set: an unset one stays absent, so HSETNX can claim it."""
        return {k: v for k, v in asdict(self).items() if v not in (0, "")}

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> BatchRecord:
        h = {_s(k): _s(v) for k, v in raw.items()}
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = h.get(f.name, "")
            values[f.name] = int(v or 0) if f.type == "int" else v
        return cls(**values)

    def owned_by(self, owner: str) -> bool:
        return hmac.compare_digest(self.owner, owner)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def input_errors(e: Exception) -> str:
    """OpenAI's `errors` of a batch that failed before it ran: its line errors, or the one reason."""
    if isinstance(e, InputError) and e.errors:
        data = [
            {"code": "invalid_request", "line": le.line_no, "message": le.reason, "param": le.field or None}
            for le in e.errors
        ]
    else:
        data = [{"code": "invalid_file", "line": None, "message": str(e), "param": None}]
    return orjson.dumps({"object": "list", "data": data}).decode()


def batch_object(rec: BatchRecord, status: str, st: BatchStatus | None = None) -> dict[str, Any]:
    """OpenAI's Batch object. `st`: the running batchq batch's progress (else the recorded final counts)."""
    if st is not None:
        total, completed, failed = st.total, st.completed, st.failed
        prompt, completion, cached = st.prompt_tokens, st.completion_tokens, st.cached_prompt_tokens
        reasoning = st.reasoning_tokens
    else:
        total, completed, failed = rec.total, rec.completed, rec.failed
        prompt, completion, cached = rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens
        reasoning = rec.reasoning_tokens
    obj: dict[str, Any] = {
        "id": rec.id,
        "object": "batch",
        "endpoint": rec.endpoint,
        "errors": orjson.loads(rec.errors) if rec.errors else None,
        "input_file_id": rec.input_file_id,
        "completion_window": rec.completion_window,
        "status": status,
        "output_file_id": rec.output_file_id or None,
        "error_file_id": rec.error_file_id or None,
        "created_at": rec.created_at,
    }
    obj.update({name: getattr(rec, name) or None for name in _TIMES})
    obj["request_counts"] = {"total": total, "completed": completed, "failed": failed}
    obj["metadata"] = orjson.loads(rec.metadata) if rec.metadata else None
    obj["model"] = rec.model or None
    obj["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }
    return obj
