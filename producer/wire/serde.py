"""arq job (de)serialisers on orjson, used by producer and worker alike.

arq's default is pickle, which executes code found in a payload; anyone able to write to Redis could then
run commands on every worker. These functions speak JSON only and refuse anything else.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

# A pickle stream starts with the PROTO opcode (0x80) for protocols 2+, or with an opcode letter for
# protocols 0/1; JSON objects start with "{". Naming pickle in the error helps whoever finds it in a log.
_PICKLE_PROTO = 0x80


class PayloadRefused(ValueError):
    """A queue payload that is not a JSON object (e.g. a pickle): refused, never executed."""


def _fallback(obj: Any) -> Any:
    # arq serialises job results too, and a failed job's result is an exception object: keep its text.
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def job_serializer(data: dict[str, Any]) -> bytes:
    return orjson.dumps(data, default=_fallback)


def job_deserializer(raw: bytes) -> dict[str, Any]:
    """Parse a job payload as JSON. A pickled (or any non-JSON) payload raises PayloadRefused."""
    if raw[:1] == bytes([_PICKLE_PROTO]) or raw[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        raise PayloadRefused("job payload is not JSON (a pickle?): refused")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise PayloadRefused(f"job payload is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PayloadRefused("job payload is not a JSON object")
    return data


def mask_url(url: str) -> str:
    """The URL with its password (and a lone username-as-password) replaced by ***, for messages and logs."""
    if url.startswith("redis+sentinel://"):  # several hosts: urlsplit cannot take the netloc apart
        head, at, rest = url.partition("://")[2].rpartition("@")
        if not at:
            return url
        user, colon, _ = head.partition(":")
        return f"redis+sentinel://{user + ':***' if colon else '***'}@{rest}"
    try:
        parts = urlsplit(url)
        if parts.password is None and parts.username is None:
            return url
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = parts.username or ""
        cred = f"{user}:***" if parts.password is not None else "***"
        return urlunsplit(parts._replace(netloc=f"{cred}@{host}"))
    except ValueError:
        return "<unparseable redis url>"
