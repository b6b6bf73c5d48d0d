"""`producer serve` (`python -m producer.api`): the API server's command: its flags, its API keys, uvicorn.

The `producer` CLI hands `serve` over to this command in the same process (producer/cli/__init__.py), so
the two front-ends share the client library and import nothing of each other.
"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from producer.api.auth import API_KEYS_ENV, ApiKeys
from producer.api.server import ServerSettings, create_app
from producer.wire import keys
from producer.wire.serde import mask_url

log = logging.getLogger("batchq.server")

EPILOG = """example:
  BATCHQ_API_KEYS=sk-team-a,sk-team-b producer serve --port 8000
  producer serve --host 0.0.0.0 --api-keys-file /etc/batchq/api-keys --queue smollm2

GET /health answers 200 while Redis does; GET /metrics (no key) gives each queue's pending work
(batchq_queue_pending: queued + running) in Prometheus' text format, for an autoscaler.

exit status:
  0  stopped by SIGTERM or Ctrl-C
  2  no API key (and no --allow-no-auth), an unreadable keys file, or a bad option
"""


def _alias(value: str) -> tuple[str, str]:
    name, sep, served = value.partition("=")
    if not sep or not name.strip() or not served.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=SERVED_MODEL, got {value!r}")
    return name.strip(), served.strip()


def _queue(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("expected a queue name, got an empty one")
    return value.strip()


def build_parser() -> argparse.ArgumentParser:
    help_ = (
        "serve OpenAI's Files and Batches API over batchq (the official openai client works unchanged), "
        "and the batch console in the browser at / (sign in with an API key)"
    )
    p = argparse.ArgumentParser(
        prog="producer serve",
        description=help_,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--redis-url",
        default=keys.redis_url_from_env(),
        help="Redis URL; redis://user:pass@host:port/db and rediss:// (TLS) work "
        f"(env {keys.REDIS_URL_ENV}, default {keys.DEFAULT_REDIS_URL})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--queue", help="queue the batches go to (default: default)")
    p.add_argument(
        "--model",
        help="the model every batch is for, where a line names none (an OpenAI line's body.model names its "
        "own); a worker serving another model refuses such requests (model_not_found)",
    )
    p.add_argument(
        "--model-alias",
        type=_alias,
        action="append",
        default=[],
        metavar="NAME=SERVED",
        help="run requests that name model NAME on the model SERVED (repeatable), e.g. "
        "gpt-4o-mini=smollm2-135m; results name the model that ran",
    )
    p.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="bearer API keys, one per line (# comments), in addition to $BATCHQ_API_KEYS (comma-separated)",
    )
    p.add_argument(
        "--allow-no-auth",
        action="store_true",
        help="without any API key, serve an open API (refused otherwise): anyone reaching the port sees all",
    )
    p.add_argument(
        "--max-upload-mb",
        type=float,
        default=200,
        metavar="MB",
        help="largest upload (default 200, OpenAI's)",
    )
    p.add_argument(
        "--metrics-queue",
        type=_queue,
        action="append",
        default=[],
        metavar="QUEUE",
        help="a queue whose pending work /metrics reports even before its first batch (repeatable; the "
        "--queue one always is, and so is every queue a batch went to): one per autoscaled worker queue",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    return serve(build_parser().parse_args(argv))


def serve(args: argparse.Namespace) -> int:
    """Load the keys, refuse an open API unless asked for, run uvicorn until signalled."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        api_keys = ApiKeys.load(os.environ.get(API_KEYS_ENV), args.api_keys_file)
    except (OSError, ValueError) as e:
        log.error("cannot load API keys: %s", e.strerror if isinstance(e, OSError) else e)
        return 2
    where = f"http://{args.host}:{args.port}/v1"
    if api_keys.open:
        if not args.allow_no_auth:
            log.error(
                "no API keys: set %s (comma-separated) or --api-keys-file, or pass --allow-no-auth to serve "
                "an open API",
                API_KEYS_ENV,
            )
            return 2
        log.warning(
            "the API is OPEN (--allow-no-auth): anyone who reaches %s can submit and read every batch", where
        )
    else:
        log.info("%d API key(s) loaded; each key sees only its own files and batches", len(api_keys))
    settings = ServerSettings(
        redis_url=args.redis_url,
        keys=api_keys,
        queue=args.queue,
        model=args.model,
        model_aliases=tuple(args.model_alias),
        max_upload_bytes=int(args.max_upload_mb * 1024 * 1024),
        metrics_queues=tuple(args.metrics_queue),
    )
    log.info(
        "serving %s over Redis %s, queue %s", where, mask_url(args.redis_url), keys.queue_name(args.queue)
    )
    log.info("the batch console: http://%s:%d/", args.host, args.port)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    return 0
