"""What the console's tests run against: a real Redis, a real worker on a tiny random Llama and a real
`producer serve` process with two team keys; and the CLI, run as a team runs it.

The console tests (test_console_api.py, test_console_browser.py) share one stack per session through the
`console_stack` fixture of tests/producer/conftest.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tests.tiny_models import build_tiny_checkpoint
from tests.worker.conftest import ROOT, Worker
from worker.embedded_redis import RedisServer, free_port

KEY_A, KEY_B = (f"sk-console-{team}-{uuid.uuid4().hex}" for team in ("a", "b"))
# A labeling batch whose prompts all start with one instruction: the labels page says it once.
SHARED = "Classify the sentiment of this customer review as positive, negative or neutral. Review:"
REVIEWS = ["great phone", "broke at once", "it is fine, I guess", "love it"]


def shared_instruction_lines(tag: str) -> list[dict[str, Any]]:
    return [{"id": f"{tag}-{i + 1}", "prompt": f"{SHARED}\n{text}\nSentiment:", "temperature": 0,
             "choices": ["positive", "negative", "neutral"], "max_tokens": 4}
            for i, text in enumerate(REVIEWS)]  # fmt: skip


class ConsoleServer:
    """A `producer serve` process with the two keys in a keys file, its log in a file."""

    def __init__(self, redis_url: str, keys_file: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "serve.log"
        cmd = [sys.executable, "-m", "producer.cli", "serve", "--port", str(self.port), "--redis-url", redis_url,
               "--api-keys-file", str(keys_file)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("BATCHQ_API_KEYS", "BATCHQ_API_KEY")}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def wait_ready(self, timeout: float = 60.0) -> ConsoleServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Stack:
    redis: RedisServer
    worker: Worker
    server: ConsoleServer
    tmp: Path

    def cli(
        self, *args: str, key: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        """`producer ARGS` against the stack's Redis, with $BATCHQ_API_KEY set to `key` (None: unset)."""
        env = {k: v for k, v in os.environ.items() if k != "BATCHQ_API_KEY"}
        if key is not None:
            env["BATCHQ_API_KEY"] = key
        cmd = [sys.executable, "-m", "producer.cli", args[0], *args[1:], "--redis-url", self.redis.url]
        return subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env, check=check, timeout=120)

    def submit(self, lines: list[dict[str, Any]], *args: str, key: str | None = KEY_A) -> str:
        """Submit `lines` with the CLI (as team `key`); returns the batch id."""
        path = self.tmp / f"in-{uuid.uuid4().hex[:8]}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        return self.cli("submit", str(path), *args, key=key).stdout.decode().strip()

    def status(self, batch_id: str) -> dict[str, Any]:
        """What `producer status --json` reads."""
        return dict(orjson.loads(self.cli("status", batch_id, "--json").stdout))

    def results(self, batch_id: str) -> list[dict[str, Any]]:
        return [orjson.loads(x) for x in self.cli("results", batch_id).stdout.splitlines()]

    def wait(self, batch_id: str, timeout: float = 90.0) -> dict[str, Any]:
        self.cli("wait", batch_id, "--timeout", str(timeout), check=False)
        return self.status(batch_id)

    def get(self, path: str, key: str | None) -> tuple[int, bytes, dict[str, str]]:
        """A GET of the server with `key` as the bearer token (None: no Authorization header)."""
        req = urllib.request.Request(self.server.base + path)
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)


def start_stack(tmp: Path) -> Iterator[Stack]:
    model = build_tiny_checkpoint(tmp / "tiny", "llama", max_position_embeddings=1024)
    store = RedisServer(appendonly=False).start()
    keys_file = tmp / "api-keys"
    keys_file.write_text(f"{KEY_A}\n{KEY_B}\n")
    worker = Worker(store.url, str(model), tmp, "console", "--max-num-seqs", "4", "--dtype", "float32",
                    "--repetition-repeats", "0")  # fmt: skip
    server = ConsoleServer(store.url, keys_file, tmp)
    try:
        server.wait_ready()
        worker.wait_ready()
        yield Stack(store, worker, server, tmp)
    finally:
        server.stop()
        worker.stop()
        store.close()
