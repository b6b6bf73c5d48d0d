"""Reliability promises under real faults: SIGKILL, SIGTERM, Redis restarts, poison requests, pickles.

Workers are real processes on a small random Llama (fast to load and step); Redis is a real server the
test owns, with AOF, so it can be killed and restarted.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import redis
from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix

from producer.wire import keys
from tests.worker.conftest import Worker, assert_consistent, results_count, submit, wait_until, write_jsonl

pytestmark = pytest.mark.slow

# The random model loops at once under greedy decoding: switch loop detection off so lengths are exact.
FAST = [
    "--lease-s",
    "2",
    "--max-num-seqs",
    "4",
    "--prefetch",
    "2",
    "--kv-cache-gb",
    "0.05",
    "--repetition-repeats",
    "0",
]


def long_requests(n: int, max_new: int = 250) -> list[dict[str, object]]:
    # ignore_eos + temperature 0: each request runs exactly max_new steps on the random model.
    return [
        {"id": f"r{i}", "prompt": f"Request number {i}: write a long answer.", "max_new_tokens": max_new,
         "temperature": 0, "ignore_eos": True}
        for i in range(n)
    ]  # fmt: skip


def running_on(url: str, batch_id: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return int(r.scard(keys.batch_running(batch_id)))
    finally:
        r.close()


def test_sigkilled_worker_requests_are_rerun_by_another_within_the_lease(
    server, workers, tiny_model_dir, tmp_path
):
    a = workers(server.url, str(tiny_model_dir), *FAST, name="a").wait_ready()
    b = workers(server.url, str(tiny_model_dir), *FAST, name="b").wait_ready()
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(24)))
    # Kill worker a while it holds requests mid-generation.
    r = redis.Redis.from_url(server.url)
    wait_until(lambda: any(r.exists(in_progress_key_prefix + keys.job_id(bid, i)) for i in range(24))
               and running_on(server.url, bid) >= 2, 60, "requests in flight")  # fmt: skip
    a.signal(signal.SIGKILL)
    a.wait(10)
    killed_at = time.monotonic()
    wait_until(lambda: results_count(server.url, bid) == 24, 120, "all results")
    r.close()
    results = assert_consistent(server.url, bid, 24)
    assert all(x["finish_reason"] == "length" for x in results.values()), results
    assert all(x["usage"]["completion_tokens"] == 250 for x in results.values())
    assert b.proc.poll() is None
    assert time.monotonic() - killed_at < 120


def test_sigterm_finishes_or_hands_back_without_burning_a_try(server, workers, tiny_model_dir, tmp_path):
    # max_tries=1: a hand-back that counted as a try would turn into a max_tries_exceeded error.
    args = [*FAST, "--max-tries", "1", "--shutdown-grace-s", "0.3"]
    a = workers(server.url, str(tiny_model_dir), *args, name="a").wait_ready()
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(12, max_new=400)))
    wait_until(lambda: running_on(server.url, bid) >= 2, 60, "requests in flight")
    t0 = time.monotonic()
    a.signal(signal.SIGTERM)
    assert a.wait(30) == 0, a.log()
    assert time.monotonic() - t0 < 15
    assert "handing" in a.full_log()
    assert results_count(server.url, bid) < 12
    # The handed-back requests are free at once (no lease to wait for) and run on the next worker.
    workers(server.url, str(tiny_model_dir), *args, name="b").wait_ready()
    wait_until(lambda: results_count(server.url, bid) == 12, 120, "all results")
    results = assert_consistent(server.url, bid, 12)
    assert [x["finish_reason"] for x in results.values()] == ["length"] * 12, results


def test_worker_survives_a_redis_restart_and_the_batch_completes(server, workers, tiny_model_dir, tmp_path):
    a = workers(server.url, str(tiny_model_dir), *FAST, name="a").wait_ready()
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(16, max_new=200)))
    wait_until(lambda: results_count(server.url, bid) >= 2, 60, "first results")
    server.kill()
    time.sleep(4)  # longer than redis-py's own retries: the worker itself must back off and resume
    server.start()
    wait_until(lambda: results_count(server.url, bid) == 16, 120, "all results after the restart")
    assert a.proc.poll() is None, a.log()
    results = assert_consistent(server.url, bid, 16)
    assert all(x["finish_reason"] == "length" for x in results.values())
    log = a.full_log()
    assert "redis unavailable" in log
    # Jobs that finished during the outage are dequeued once Redis is back, not dropped unobserved.
    assert "never retrieved" not in log and "Traceback" not in log, a.log()


def test_request_that_keeps_killing_workers_fails_after_max_tries(server, workers, tiny_model_dir, tmp_path):
    lines = long_requests(1, max_new=900) + [
        {"id": f"ok{i}", "prompt": f"short {i}", "max_new_tokens": 5, "temperature": 0} for i in range(3)
    ]
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", lines))
    args = [
        "--lease-s",
        "1",
        "--max-tries",
        "2",
        "--max-num-seqs",
        "1",
        "--prefetch",
        "0",
        "--repetition-repeats",
        "0",
    ]
    # A claim that finds the request still running (its worker died with it) counts a failed try here.
    tries = retry_key_prefix + keys.job_id(bid, 0)
    r = redis.Redis.from_url(server.url)

    def started(attempt: int, w: Worker) -> bool:
        assert w.proc.poll() is None, f"worker w{attempt} exited before the poison started:\n{w.log()}"
        assert not r.hexists(keys.batch_results(bid), "0"), "the poison request finished before the kill"
        if attempt == 0:
            return bool(r.sismember(keys.batch_running(bid), "0"))
        return int(r.get(tries) or 0) >= attempt

    def state(w: Worker) -> str:  # what a timeout needs to be understood
        return (
            f"running {sorted(r.smembers(keys.batch_running(bid)))}, tries {r.get(tries)}, results "
            f"{sorted(r.hkeys(keys.batch_results(bid)))}, queue {r.zrange(keys.queue_name('default'), 0, -1, withscores=True)}"
            f"\nworker log:\n{w.log()}"
        )

    for attempt in range(2):
        # Kill as soon as the try starts, watched from the worker's start: a worker claims the moment it is
        # ready, and a fast machine finished the 900 tokens (and left the running set) inside wait_ready's
        # 0.2 s polls, so the start was never seen.
        w = workers(server.url, str(tiny_model_dir), *args, name=f"w{attempt}")
        try:
            wait_until(lambda: started(attempt, w), 180, "poison started", interval=0.005)  # noqa: B023
        except AssertionError as e:
            raise AssertionError(f"attempt {attempt}: {e}\n{state(w)}") from None
        w.signal(signal.SIGKILL)  # "the request kills the worker"
        w.wait(10)
        assert not r.hexists(keys.batch_results(bid), "0"), "the poison request finished before the kill"
    workers(server.url, str(tiny_model_dir), *args, name="w2").wait_ready()
    wait_until(lambda: results_count(server.url, bid) == 4, 60, "all results")
    r.close()
    results = assert_consistent(server.url, bid, 4)
    assert results[0]["finish_reason"] == "error"
    assert results[0]["error"]["type"] == "max_tries_exceeded"
    assert [results[i]["finish_reason"] for i in (1, 2, 3)] == ["length"] * 3


def test_pickled_payload_in_the_queue_is_refused_not_executed(
    server, workers, tiny_model_dir, tmp_path: Path
):
    marker = tmp_path / "pwned"
    # A classic protocol-0 pickle that would run `touch marker` if anything unpickled it.
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    qname = keys.queue_name("default")
    r = redis.Redis.from_url(server.url)
    r.set(job_key_prefix + "evil", payload)
    r.zadd(qname, {"evil": 1})
    a = workers(server.url, str(tiny_model_dir), *FAST, name="a").wait_ready()
    wait_until(lambda: r.zscore(qname, "evil") is None, 30, "the bad job to leave the queue")
    # The worker is still healthy and serves real work afterwards.
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", long_requests(2, max_new=3)))
    wait_until(lambda: results_count(server.url, bid) == 2, 60, "results after the bad job")
    r.close()
    assert not marker.exists()
    assert a.proc.poll() is None
