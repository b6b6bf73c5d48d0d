"""`worker --data-parallel-size 2`: two engine groups under one supervisor, each a worker of its own with its
own heartbeat; a group that dies is started again; SIGTERM drains both and the supervisor exits 0, leaving
no process behind."""

from __future__ import annotations

import signal
import subprocess

import pytest
import redis

from producer.wire import keys
from tests.worker.conftest import assert_consistent, results_count, submit, wait_until, write_jsonl
from tests.worker.test_faults import FAST

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def heartbeats(url: str, ids: list[str]) -> bool:
    r = redis.Redis.from_url(url)
    try:
        return all(r.exists(keys.worker_heartbeat(i)) for i in ids)
    finally:
        r.close()


def test_two_groups_serve_a_batch_restart_when_killed_and_drain_on_sigterm(
    server, workers, tiny_model_dir, tmp_path
):
    sup = workers(server.url, str(tiny_model_dir), *FAST, "--data-parallel-size", "2", name="dp")
    groups = [f"{sup.id}-dp0", f"{sup.id}-dp1"]
    wait_until(lambda: heartbeats(server.url, groups), 180, f"both groups' heartbeats:\n{sup.log()}")
    lines = [
        {"id": f"q{i}", "prompt": f"Question {i}?", "max_new_tokens": 8, "temperature": 0} for i in range(16)
    ]
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", lines))
    wait_until(lambda: results_count(server.url, bid) == 16, 120, "every result")
    assert_consistent(server.url, bid, 16)
    first = children(sup.proc.pid)
    assert len(first) == 2
    subprocess.run(["kill", "-9", str(first[0])], check=True)
    wait_until(lambda: len(set(children(sup.proc.pid)) - set(first)) == 1, 30, f"a new group:\n{sup.log()}")
    assert "exited with status -9: starting it again" in sup.full_log()
    wait_until(lambda: heartbeats(server.url, groups), 180, "the restarted group's heartbeat")
    now = children(sup.proc.pid)
    sup.signal(signal.SIGTERM)
    assert sup.wait(60) == 0, sup.log()
    assert all(subprocess.run(["ps", "-p", str(p)], capture_output=True).returncode != 0 for p in now)
