"""`python -m producer.cli.check FILE [--model M]`: validate a JSONL file as `producer submit` does (every line:
the contract, duplicate ids, grammars that must compile), without Redis and without enqueuing anything.

Exit 0 when every line is valid; else 2, with each bad line's number, field and reason on stderr as `producer
submit` prints them. `make run` runs it before it starts Redis or a worker (worker/run_main.py, which imports
nothing of the client), so that a broken file fails in a second rather than after the model has loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from producer.client.images import ImageChecks
from producer.client.submit import SubmitChecks, SubmitReport, validate_to_spool

OK, INVALID = 0, 2


def check_file(path: str, model: str | None = None) -> int:
    """Validate `path` line by line; print what is wrong with it on stderr. Returns the exit status."""
    report = SubmitReport(batch_id="check")
    checks = SubmitChecks(images=ImageChecks(folder=Path(path).absolute().parent))  # file:// images as submit
    try:
        with open(path, "rb") as stream, open(os.devnull, "wb") as spool:
            validate_to_spool(stream, spool, report, defaults=None, model=model, checks=checks)
    except OSError as e:
        print(f"error: {path}: {e.strerror or e}", file=sys.stderr)
        return INVALID
    if report.total == 0:
        print(f"error: {path}: input is empty: no request lines", file=sys.stderr)
        return INVALID
    if not report.invalid:
        return OK
    print(f"error: {path}: {report.invalid} invalid line(s) of {report.total}", file=sys.stderr)
    for le in report.errors:
        print(f"  {le}", file=sys.stderr)
    if report.invalid > len(report.errors):
        print(f"  ... and {report.invalid - len(report.errors)} more", file=sys.stderr)
    return INVALID


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m producer.cli.check",
        description="validate a JSONL file as `producer submit` does, without Redis; exit 2 on a bad line",
    )
    p.add_argument("file", help="the JSONL file")
    p.add_argument("--model", help="the model lines that name none are for (as submit's --model)")
    ns = p.parse_args(argv)
    return check_file(ns.file, ns.model)


if __name__ == "__main__":
    sys.exit(main())
