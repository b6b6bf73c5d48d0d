"""Who owns a batch: the owner id of an API key (a team's key), shared by `producer serve`, which checks
keys, and `producer submit`, which records the owner of a batch it submits with $BATCHQ_API_KEY set.

An owner id is a salted hash of the key: not the key, and not the digest the server compares, so Redis
never holds anything that signs in.
"""

from __future__ import annotations

import hashlib
import os

API_KEY_ENV = "BATCHQ_API_KEY"  # the one key `producer submit` records its batches' owner with
OPEN_OWNER = "open"  # every caller's owner id when the API runs without keys (--allow-no-auth)
_OWNER_SALT = b"batchq-api-owner\0"


def owner_id(key: str) -> str:
    """The id objects are stored under for `key`."""
    return hashlib.sha256(_OWNER_SALT + key.encode()).hexdigest()[:32]


def owner_from_env() -> str | None:
    """The owner id of $BATCHQ_API_KEY, None when it is unset or blank."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    return owner_id(key) if key else None
