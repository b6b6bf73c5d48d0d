"""Every Redis key name and prefix batchq uses, and the Redis defaults, in one place (arq's constants.py).

arq's own keys (queue zset, `arq:job:*`, `arq:in-progress:*`, `arq:retry:*`, `arq:result:*`) come from
`arq.constants`; everything batchq adds lives under `batchq:`.
"""

from __future__ import annotations

import os

REDIS_URL_ENV = "REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_TTL_S = 7 * 24 * 3600  # results and batch state are kept this long after a batch ends


def redis_url_from_env() -> str:
    """$REDIS_URL, else DEFAULT_REDIS_URL: the default of every command that connects."""
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


PREFIX = "batchq:"
DEFAULT_QUEUE = "batchq:queue:default"
JOB_FUNCTION = "run_request"

BATCHES = PREFIX + "batches"  # zset: batch_id -> created_at
WORKERS = PREFIX + "workers"  # zset: worker_id -> last heartbeat (unix s)


def queue_name(name: str | None) -> str:
    """User-facing queue names are short ("default", "smollm2"); Redis keys carry the prefix."""
    if not name:
        return DEFAULT_QUEUE
    return name if name.startswith(PREFIX) else f"{PREFIX}queue:{name}"


def batch_meta(batch_id: str) -> str:
    """hash: total, created_at, finished_at, queue, model, counters, token totals, cancelled flag."""
    return f"{PREFIX}batch:{batch_id}"


def batch_results(batch_id: str) -> str:
    """hash: request index -> Result JSON (HSETNX: the first write wins)."""
    return f"{PREFIX}batch:{batch_id}:results"


def batch_running(batch_id: str) -> str:
    """set: request indices a worker is running right now."""
    return f"{PREFIX}batch:{batch_id}:running"


def job_id(batch_id: str, index: int, attempt: int = 0) -> str:
    """Deterministic arq job id: resubmitting the same batch enqueues nothing twice. A retry's attempt n > 0
    gets its own id (`<batch>:<index>.<n>`), so the finishing of an older attempt never touches its job."""
    return f"{job_id_prefix(batch_id)}{index}" + (f".{attempt}" if attempt else "")


def job_id_prefix(batch_id: str) -> str:
    """What every job id of a batch starts with; submit's Lua script appends the index itself."""
    return f"{batch_id}:"


def split_job_id(jid: str) -> tuple[str, int, int]:
    """(batch id, index, attempt) of a job id made by job_id."""
    batch_id, _, rest = jid.rpartition(":")
    idx, _, attempt = rest.partition(".")
    return batch_id, int(idx), int(attempt or 0)


def batch_digests(batch_id: str) -> str:
    """string: each request's content digest (submit.DIGEST_BYTES each, in index order), written when the
    batch is created: a resubmission under the same id with other content is refused, naming the line."""
    return f"{PREFIX}batch:{batch_id}:digests"


def batch_attempts(batch_id: str) -> str:
    """hash: request index -> its current attempt number, for requests `producer retry` re-enqueued (absent:
    attempt 0). A result is stored only by its request's current attempt (store.write_result)."""
    return f"{PREFIX}batch:{batch_id}:attempts"


def batch_requests(batch_id: str) -> str:
    """hash: request index -> the request's queue payload (JSON), kept for requests that ended failed,
    cancelled or timed out, so that `producer retry` can enqueue them again."""
    return f"{PREFIX}batch:{batch_id}:requests"


def batch_inputs(batch_id: str) -> str:
    """hash: n -> JSON list of the input excerpts (the prompt, or the last user message) of requests
    n * store.EXCERPTS_PER_FIELD onwards (null: an invalid line), written at submit for the console's rows
    to review (producer/api/console_api.py)."""
    return f"{PREFIX}batch:{batch_id}:inputs"


def worker_heartbeat(worker_id: str) -> str:
    """string with TTL: the worker's last health snapshot (JSON)."""
    return f"{PREFIX}worker:{worker_id}"


def queue_model(queue: str) -> str:
    """string: the model a queue is bound to (set by the first worker; a mismatch is an error)."""
    return f"{PREFIX}queue-model:{queue}"


def queue_clock(queue: str) -> str:
    """string: the last enqueue millisecond handed to a submit on this queue (see producer/wire/lua/claim_ms.lua)."""
    return f"{PREFIX}queue-clock:{queue}"


def result_cache(digest: str) -> str:
    """string with TTL: a determined request's stored answer, keyed by a digest of what decides it
    (producer/wire/result_cache.py)."""
    return f"{PREFIX}result-cache:{digest}"


def image(digest: str) -> str:
    """string with TTL: an image's bytes as given (PNG, JPEG, ...), stored once by submit under the sha256 of
    those bytes (hex) for every request that shows it (producer/wire/images.py); its TTL is the longest
    result TTL of the batches that stored it, counted from their submit."""
    return f"{PREFIX}image:{digest}"


def queue_serving(queue: str) -> str:
    """string with TTL: JSON of what serves `queue` (producer/wire/workers.py QueueServing: the model, the
    engine fingerprint, the context length), set by each worker at start-up and with every heartbeat;
    submit checks requests against it and keys its result-cache lookups with it."""
    return f"{PREFIX}queue-serving:{queue}"


def batch_chat(batch_id: str) -> str:
    """bitmap: bit `index` is 1 when the request was a chat request (OpenAI output needs the object type)."""
    return f"{PREFIX}batch:{batch_id}:chat"


# ---- The OpenAI-compatible HTTP API (`producer serve`, producer/api/server.py). Servers keep no state of
# their own: every file and batch object lives here, so any instance serves any of them. `owner` is a hash
# of the API key that created an object (producer/api/auth.py), never the key.

API_PREFIX = PREFIX + "api:"
DEFAULT_FILE_TTL_S = 30 * 24 * 3600  # OpenAI's default expiry of batch files; API batch objects last as long


def api_file(file_id: str) -> str:
    """hash: a file's object fields (filename, bytes, purpose, created/expires), owner, block count, and the
    request counts by kind of an input file."""
    return f"{API_PREFIX}file:{file_id}"


def api_file_content(file_id: str) -> str:
    """list: a file's bytes in blocks of up to 1 MiB, in order (written before the file's hash exists)."""
    return f"{API_PREFIX}file:{file_id}:content"


def api_batch(batch_id: str) -> str:
    """hash: an API batch's own fields (endpoint, input file, window, metadata, owner, timestamps), and once
    it has ended its final status, counts, usage and output/error file ids. Progress before that is read
    from the batchq batch of the same id (batch_meta)."""
    return f"{API_PREFIX}batch:{batch_id}"


def api_batch_lock(batch_id: str) -> str:
    """string with TTL (a redis-py lock): the server instance now submitting or finalising the batch."""
    return f"{API_PREFIX}batch:{batch_id}:lock"


def api_owner_files(owner: str) -> str:
    """zset: file id -> created_at, the files one API key owns (listing, newest first)."""
    return f"{API_PREFIX}owner:{owner}:files"


def api_owner_batches(owner: str) -> str:
    """zset: batch id -> created_at, the batches one API key created (listing, newest first)."""
    return f"{API_PREFIX}owner:{owner}:batches"
