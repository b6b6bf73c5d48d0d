"""`make run` (worker/run_main.py): its summary's headings, and a broken prompt file refused before anything
starts. Real processes and real files; no model is loaded."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from tests.worker.conftest import ROOT
from worker.embedded_redis import redis_server_binary
from worker.run_main import summarize, validate_prompts

LABELS = ["positive", "negative", "neutral"]


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def result(rid: str, text: str, probs: list[float] | None, gold: str | None = None) -> dict[str, Any]:
    scores = None
    if probs is not None:
        scores = [{"label": lb, "logprob": -1.0, "prob": p} for lb, p in zip(LABELS, probs, strict=True)]
    return {"id": rid, "text": text, "finish_reason": "eos", "error": None,
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            "metadata": None if gold is None else {"gold": gold}, "label_scores": scores}  # fmt: skip


def sections(summary: str) -> dict[str, list[str]]:
    """Each heading of the summary -> the ids of the rows under it."""
    out: dict[str, list[str]] = {}
    heading = ""
    for line in summary.splitlines():
        if not line.startswith(" "):
            heading = line
            out[heading] = []
        elif not re.match(r"  \d+/\d+ labels match", line):
            out[heading].append(line.split()[0])
    return out


def test_the_summary_heads_label_rows_by_the_temperature_they_were_answered_at(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "Review: fine"}]
    prompts = jsonl(tmp_path / "prompts.jsonl", [
        {"id": "greedy-1", "messages": msgs, "choices": LABELS, "temperature": 0},
        {"id": "greedy-2", "messages": msgs, "choices": LABELS},  # no temperature: a choices line's 0
        {"id": "hot-1", "messages": msgs, "choices": LABELS, "temperature": 0.8, "seed": 1},
        {"id": "free", "prompt": "Say hi", "max_tokens": 5, "temperature": 0.8},
        {"id": "hot-2", "messages": msgs, "guided_choice": LABELS, "temperature": 0.8, "seed": 2},
        {"custom_id": "api-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": msgs, "choices": LABELS, "temperature": 1.5}},
    ])  # fmt: skip
    results = jsonl(tmp_path / "results.jsonl", [
        result("greedy-1", "positive", [0.7, 0.2, 0.1], gold="positive"),
        result("greedy-2", "negative", [0.3, 0.6, 0.1], gold="positive"),
        result("hot-1", "neutral", [0.5, 0.3, 0.2], gold="positive"),
        result("free", "hi there", None),
        result("hot-2", "negative", [0.4, 0.35, 0.25]),
        result("api-1", "positive", [0.34, 0.33, 0.33]),
    ])  # fmt: skip

    summary = summarize(results, 2.0, prompts)

    greedy = "labels (choices, temperature 0: the arg-max label and its probability):"
    got = sections(summary)
    assert got[greedy] == ["greedy-1", "greedy-2"], summary
    hot = [h for h in got if h.startswith("labels (choices, temperature 0.8:")]
    hotter = [h for h in got if h.startswith("labels (choices, temperature 1.5:")]
    assert len(hot) == 1 and got[hot[0]] == ["hot-1", "hot-2"], summary
    assert len(hotter) == 1 and got[hotter[0]] == ["api-1"], summary
    assert "arg-max" not in hot[0] + hotter[0] and "sampled" in hot[0]
    assert got["answers:"] == ["free"]
    assert "  1/2 labels match the gold label" in summary  # the greedy rows' tally, apart from the sampled
    assert "  0/1 labels match the gold label" in summary
    assert "hot-1        neutral        p=0.20  (gold: positive)" in summary
    assert summary.splitlines()[-1].startswith("summary: 6 requests in 2.0s")


def test_without_the_prompt_file_the_heading_claims_no_setting(tmp_path: Path) -> None:
    results = jsonl(tmp_path / "results.jsonl", [result("r1", "positive", [0.7, 0.2, 0.1])])
    summary = summarize(results, 1.0)
    assert "temperature" not in summary and "r1" in summary


def test_the_example_prompt_files_pass_the_producers_validation() -> None:
    for name in ("prompts.jsonl", "labeling.jsonl"):
        assert validate_prompts(str(ROOT / "configs" / "examples" / name), "smollm2-135m") == 0


def test_a_broken_prompt_file_exits_2_at_once_with_its_lines_and_starts_nothing(tmp_path: Path) -> None:
    """Before: Redis and the worker started and the model loaded (27 s) before submit found the bad lines."""
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(
        b'{"id": "ok", "prompt": "fine", "max_tokens": 4}\n'
        b'{"id": "bad", "prompt": "x", "colour": 1}\n'
        b'{"id": "cut", "prompt": "x"\n'
    )
    # A redis-server first on PATH that records being started (then runs the real one): `make run`'s
    # embedded Redis takes redis-server from PATH first.
    shim = tmp_path / "bin"
    shim.mkdir()
    marker = tmp_path / "redis-server-started"
    real = redis_server_binary()
    (shim / "redis-server").write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "{real}" "$@"\n')
    (shim / "redis-server").chmod(0o755)
    assert shutil.which("redis-server", path=str(shim)) is not None
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "worker.run_main", "--prompts", str(broken), "--output", str(tmp_path / "x")]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:  # whatever it started (Redis, a worker) goes with its process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    stderr = err.decode()
    assert proc.returncode == 2, (out.decode(), stderr)
    assert elapsed < 15
    assert f"{broken}: 2 invalid line(s)" in stderr
    assert "line 2: colour:" in stderr and "line 3:" in stderr
    assert "nothing was started" in stderr and "Traceback" not in stderr
    assert not marker.exists(), "a redis-server was started for a file that cannot run"
    assert not (tmp_path / ".batchq").exists() and "started" not in out.decode()
    assert not (tmp_path / "x").exists()
