"""`producer top` and the no-live-worker warning of `producer wait` / `submit --wait`, against a real Redis
with no worker at all (tests/worker/test_metrics.py runs them against a live worker)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import orjson
import pytest

from producer import cli

ROOT = Path(__file__).resolve().parents[2]
WARNING = "warning: no live worker serves queue 'nobody'"


def jsonl(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"prompt": f"p{i}"}) + b"\n" for i in range(n)))
    return path


def producer(url: str, *args: str) -> int:
    """The `producer` command, in this process (its output goes to capsys)."""
    return cli.main([*args, "--redis-url", url])


def test_wait_and_submit_wait_warn_once_when_no_worker_serves_the_queue(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(jsonl(tmp_path / "in.jsonl", 2))
    assert producer(redis_url, "submit", path, "--queue", "nobody", "--batch-id", "b1") == 0
    capsys.readouterr()
    assert producer(redis_url, "wait", "b1", "--timeout", "1") == 3
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1, err
    assert "batch b1 waits until one starts, e.g. `worker --queue nobody" in err

    assert producer(redis_url, "submit", path, "--queue", "nobody", "--wait", "--wait-timeout", "1") == 3
    assert capsys.readouterr().err.count(WARNING) == 1


def test_top_off_a_terminal_prints_one_snapshot(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert producer(redis_url, "submit", str(jsonl(tmp_path / "in.jsonl", 4)), "--batch-id", "b-top") == 0
    capsys.readouterr()
    assert producer(redis_url, "top") == 0
    out = capsys.readouterr().out
    assert "0 live workers, 1 active batch" in out and "no live workers" in out
    (row,) = [line for line in out.splitlines() if "b-top" in line]
    assert " default " in row and "0/4 0%" in row and "--:--" in row
    assert "\x1b[" not in out  # plain text, no colours or cursor moves, in a log


def test_workers_without_any_worker_says_so(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert producer(redis_url, "workers") == 0
    assert capsys.readouterr().out == "no live workers (no worker heartbeat in this Redis)\n"
    assert producer(redis_url, "workers", "--json") == 0
    assert capsys.readouterr().out == ""


def test_top_on_a_terminal_redraws_until_ctrl_c_then_exits_cleanly(redis_url: str, tmp_path: Path) -> None:
    assert producer(redis_url, "submit", str(jsonl(tmp_path / "in.jsonl", 2)), "--batch-id", "b-tty") == 0
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "top", "--interval", "0.2", "--redis-url", redis_url],
        stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env={**os.environ, "TERM": "xterm-256color"},
        # Ctrl-C's default action, as a terminal's shell gives it: run in the background (`cmd &` in a
        # script), the tests inherit SIGINT ignored, and Python then installs no KeyboardInterrupt for it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 30
        while out.count(b"b-tty") < 3 and time.monotonic() < deadline:  # three frames: it redraws
            if select.select([master], [], [], 0.5)[0]:
                out += os.read(master, 65536)
        assert out.count(b"b-tty") >= 3, out.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        # Keep reading while it exits: a frame or its screen restore written into a full terminal buffer
        # would block the child, and it would never exit.
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
        assert proc.wait(max(0.1, deadline - time.monotonic())) == 0
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert "Traceback" not in text and "interrupted" not in text
    assert text.rstrip().endswith("\x1b[?25h")  # the cursor is shown again
