"""`producer redis` (and `make redis`) as a user runs it: a real process that starts a real redis-server on a
free port, prints the URL to export, and stops it, leaving nothing behind, on SIGTERM or Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.worker.conftest import ROOT

EXPORT = "export REDIS_URL="


def start(*args: str) -> tuple[subprocess.Popen[str], str]:
    """`python -m producer.cli redis ARGS`, and the URL of its first line (export REDIS_URL=...)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "redis", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the server answers (or the command fails)
    if not line.startswith(EXPORT):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"no export line: {line!r}; stderr: {err}")
    return proc, line.strip().removeprefix(EXPORT)


def server_facts(url: str) -> tuple[int, int, str]:
    """(port, pid, data dir) of the Redis at `url`, as it reports them."""
    client = redis.Redis.from_url(url)
    try:
        assert client.ping() is True
        info = client.info("server")
        data_dir = client.config_get("dir")["dir"]
        return int(info["tcp_port"]), int(info["process_id"]), str(data_dir)
    finally:
        client.close()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_producer_redis_serves_on_a_free_port_until_a_signal_then_leaves_nothing(sig: int) -> None:
    proc, url = start()
    try:
        assert url.startswith("redis://127.0.0.1:") and url.endswith("/0")
        port, pid, data_dir = server_facts(url)
        assert port != 6379 and f":{port}/" in url  # a port of its own, never whatever answers on 6379
        assert Path(data_dir).is_dir()
        client = redis.Redis.from_url(url)
        client.set("k", "v")  # a working Redis, not only one that answers PING
        assert client.get("k") == b"v"
        client.close()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert gone(pid), "redis-server outlived `producer redis`"
    assert not Path(data_dir).exists(), "its temporary data directory was left behind"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert "Traceback" not in err


def test_producer_redis_keeps_its_data_in_dir_and_refuses_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "producer.cli", "redis", "--port", str(port)],
            capture_output=True, text=True, cwd=ROOT, timeout=30, check=False,
        )  # fmt: skip
    assert out.returncode == 1 and out.stdout == ""
    assert f"127.0.0.1:{port} is taken" in out.stderr and "Traceback" not in out.stderr

    data = tmp_path / "redis-data"
    proc, url = start("--dir", str(data))
    try:
        _, pid, data_dir = server_facts(url)
        assert Path(data_dir) == data.resolve()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and gone(pid)
    assert data.is_dir() and any(data.iterdir()), "--dir keeps the data (AOF) after exit"
