"""`worker --tensor-parallel-size 2` as users run it: real worker processes with their rank processes, a real
Redis, real signals. A two-rank worker answers a batch as a one-rank worker does; SIGTERM drains the whole
group and exits 0; a rank killed mid-batch takes its worker down at once (exit status 3, nothing written),
and another worker answers every request exactly once; no rank process outlives its worker."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.worker.conftest import assert_consistent, results_count, submit, wait_until, write_jsonl
from tests.worker.test_faults import FAST, long_requests, running_on

pytestmark = pytest.mark.slow

TP2 = ["--tensor-parallel-size", "2"]


def ranks_of(pid: int) -> list[int]:
    """The rank processes a worker started: its children running worker.engine.tensor_parallel."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True)
    return [
        int(line.split()[0]) for line in out.stdout.splitlines() if "worker.engine.tensor_parallel" in line
    ]


def alive(pid: int) -> bool:
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return out.returncode == 0 and not out.stdout.strip().startswith("Z")


def greedy_lines(n: int) -> list[dict[str, object]]:
    return [{"id": f"q{i}", "prompt": f"Question {i}: what comes next?", "max_new_tokens": 12, "temperature": 0}
            for i in range(n)]  # fmt: skip


def texts(url: str, bid: str, n: int) -> dict[int, str]:
    return {i: r["text"] for i, r in assert_consistent(url, bid, n).items()}


def test_a_two_rank_worker_answers_as_a_one_rank_worker_and_sigterm_ends_its_group(
    server, workers, tiny_model_dir, tmp_path
):
    lines = write_jsonl(tmp_path / "in.jsonl", greedy_lines(8))
    split = workers(server.url, str(tiny_model_dir), *FAST, *TP2, name="tp2").wait_ready()
    ranks = ranks_of(split.proc.pid)
    assert len(ranks) == 1, split.log()
    bid = submit(server.url, lines)
    wait_until(lambda: results_count(server.url, bid) == 8, 120, "the two-rank worker's results")
    split.signal(signal.SIGTERM)
    assert split.wait(60) == 0, split.log()
    assert not any(alive(p) for p in ranks)
    whole = workers(server.url, str(tiny_model_dir), *FAST, name="tp1").wait_ready()
    again = submit(server.url, lines, "--no-result-cache")
    wait_until(lambda: results_count(server.url, again) == 8, 120, "the one-rank worker's results")
    assert texts(server.url, again, 8) == texts(server.url, bid, 8)
    assert whole.proc.poll() is None


def test_a_rank_killed_mid_batch_leaves_every_request_answered_exactly_once(
    server, workers, tiny_model_dir, tmp_path
):
    split = workers(server.url, str(tiny_model_dir), *FAST, *TP2, name="tp2").wait_ready()
    other = workers(server.url, str(tiny_model_dir), *FAST, name="tp1").wait_ready()
    (rank,) = ranks_of(split.proc.pid)
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(12)))
    wait_until(lambda: running_on(server.url, bid) >= 2, 60, "requests in flight")
    subprocess.run(["kill", "-9", str(rank)], check=True)
    t0 = time.monotonic()
    assert split.wait(30) == 3, split.log()
    assert time.monotonic() - t0 < 10
    assert "so that the leased requests run elsewhere" in split.full_log()
    wait_until(lambda: results_count(server.url, bid) == 12, 180, "every result")
    results = assert_consistent(server.url, bid, 12)
    assert all(x["finish_reason"] == "length" and x["error"] is None for x in results.values()), results
    assert other.proc.poll() is None
    assert ranks_of(split.proc.pid) == []
