"""`producer`: submit JSONL batches to batchq and follow them. A thin argparse layer over BatchqClient.

`producer serve` is the HTTP API's own command (producer/api/serve.py): this process becomes it, so the
CLI and the API share the client and import nothing of each other.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import NoReturn

from producer.cli import commands
from producer.cli.parser import build_parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "local", None) is not None:  # `producer redis`: runs no client
        return int(args.local(args))
    try:
        code = asyncio.run(commands.run(args.handler, args))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = 130
    return code


def serve(argv: list[str]) -> NoReturn:
    """Run `python -m producer.api ARGV` in this process: exec keeps the pid, so the signals a supervisor
    sends `producer serve` reach uvicorn, and starlette and uvicorn load for this command only."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "producer.api", *argv])
