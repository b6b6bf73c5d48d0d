"""API keys of the HTTP API: read once at start-up, compared in constant time, never stored nor logged.

A caller is known by its owner id, a hash of its key. Files and batches record the owner id of the key
that created them, so a key sees only its own objects, and Redis never holds a key. Keys come from
$BATCHQ_API_KEYS (comma-separated) and from a keys file (one per line; blank lines and # comments skipped).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from producer.wire.owner import OPEN_OWNER, owner_id

__all__ = ["API_KEYS_ENV", "OPEN_OWNER", "ApiKeys", "owner_id", "parse_keys"]

API_KEYS_ENV = "BATCHQ_API_KEYS"


def parse_keys(text: str, *, sep: str) -> list[str]:
    """Keys from an environment value (sep=",") or a file's text (sep="\\n"); # starts a comment line."""
    out = []
    for part in text.split(sep):
        key = part.strip()
        if key and not key.startswith("#"):
            if any(c.isspace() for c in key):
                raise ValueError("an API key may not contain whitespace")
            out.append(key)
    return out


class ApiKeys:
    """The accepted keys, kept only as SHA-256 digests (with each key's owner id)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [(hashlib.sha256(k.encode()).digest(), owner_id(k)) for k in dict.fromkeys(keys)]

    @classmethod
    def load(cls, env_value: str | None, path: str | None) -> ApiKeys:
        """Keys from the environment value and the file (both may be given). Raises ValueError or OSError,
        with messages that never quote a key."""
        keys = parse_keys(env_value or "", sep=",")
        if path:
            keys += parse_keys(Path(path).read_text(encoding="utf-8"), sep="\n")
        return cls(keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def open(self) -> bool:
        """No keys: every request is let in (only with --allow-no-auth)."""
        return not self._keys

    def owner(self, authorization: str | None) -> str | None:
        """The owner id for an `Authorization: Bearer <key>` header; None for a missing or wrong key.

        Every stored digest is compared, in constant time, whatever matches: the time taken says nothing
        about which key, or how much of one, was right.
        """
        if self.open:
            return OPEN_OWNER
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for stored, owner in self._keys:
            if hmac.compare_digest(digest, stored):
                found = owner
        return found
