"""The `producer` console script as a user runs it: exit statuses, messages, output files."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from redis.asyncio import Redis

from producer.wire import keys, store
from producer.wire.results import ErrorInfo, Result, Usage

PRODUCER = Path(sys.executable).with_name("producer")
pytestmark = pytest.mark.skipif(not PRODUCER.exists(), reason="run `pip install -e .` for the console script")

CHAT = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}}  # fmt: skip
TEXT = {"custom_id": "t1", "url": "/v1/completions", "body": {"prompt": "abc"}}


def cli(url: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": url}
    proc = subprocess.run(
        [str(PRODUCER), *args], input=stdin.decode() if stdin else None, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return proc


def jsonl(path: Path, *lines: object) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def test_every_command_help_shows_an_example_and_the_exit_statuses(redis_url: str) -> None:
    for cmd in ("submit", "status", "wait", "results", "cancel", "list"):
        out = cli(redis_url, cmd, "--help")
        assert out.returncode == 0 and "example:\n  producer " + cmd in out.stdout
        assert "3  wait: the --timeout passed" in out.stdout and "4  wait: the batch finished" in out.stdout


def test_invalid_file_exits_2_lists_bad_lines_and_enqueues_nothing(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n' + b'{"prompt": "x", "colour": 1}\n' * 25)
    out = cli(redis_url, "submit", str(path), "--batch-id", "b1")
    assert out.returncode == 2 and out.stdout == ""
    err = out.stderr.splitlines()
    assert err[0] == f"error: {path}: 25 invalid line(s); nothing was enqueued"
    assert err[1] == "  line 2: colour: unknown field" and err[20] == "  line 21: colour: unknown field"
    assert err[21:] == ["  ... and 5 more"]
    assert "Traceback" not in out.stderr
    assert cli(redis_url, "status", "b1").returncode == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "error: no such file: "),
        (b"", ": input is empty: no request lines"),
        (b'{"prompt": "\xff\xfe"}\n', ": 1 invalid line(s); nothing was enqueued\n  line 1: not valid UTF-8"),
    ],
)
def test_file_problems_are_one_clear_line(
    redis_url: str, tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "in.jsonl"
    if content is not None:
        path.write_bytes(content)
    out = cli(redis_url, "submit", str(path))
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_unreachable_redis_is_one_line_without_the_password(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "x"})
    out = cli("redis://alice:hunter2@127.0.0.1:1/0", "submit", str(path))
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot reach Redis at redis://alice:***@127.0.0.1:1/0")
    assert "hunter2" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_bad_batch_default_names_the_option(redis_url: str, tmp_path: Path) -> None:
    out = cli(redis_url, "submit", str(jsonl(tmp_path / "in.jsonl", {"prompt": "x"})), "--top-p", "2")
    assert out.returncode == 2 and out.stderr.startswith(
        "error: --top-p: Input should be less than or equal to 1"
    )


async def finish(url: str, batch_id: str, results: list[Result]) -> None:
    redis = Redis.from_url(url)
    for r in results:
        await store.write_result(redis, batch_id, r)
    await redis.aclose()


def ok(i: int, id_: str, reason: str = "eos") -> Result:
    """A result as a worker serving smollm2-135m writes it."""
    return Result(id=id_, index=i, text=f"answer {i}", finish_reason=reason, model="smollm2-135m",
                  usage=Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6))  # fmt: skip


def test_submit_status_wait_results_round_trip(redis_url: str, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "in.jsonl", CHAT, TEXT)
    out = cli(
        redis_url, "submit", str(path), "--batch-id", "b1", "--json", "--temperature", "0", "--stop", "x"
    )
    assert out.returncode == 0, out.stderr
    assert orjson.loads(out.stdout) == {
        "batch_id": "b1",
        "total": 2,
        "enqueued": 2,
        "cached": 0,
        "invalid": 0,
    }

    assert cli(redis_url, "wait", "b1", "--timeout", "0.3").returncode == 3
    asyncio.run(finish(redis_url, "b1", [ok(0, "c1"), ok(1, "t1", "length")]))
    wait = cli(redis_url, "wait", "b1")
    assert wait.returncode == 0 and "2/2" in wait.stderr

    status = orjson.loads(cli(redis_url, "status", "b1", "--json").stdout)
    assert {k: status[k] for k in ("state", "total", "queued", "running", "completed", "failed", "cancelled")} == {
        "state": "completed", "total": 2, "queued": 0, "running": 0, "completed": 2, "failed": 0, "cancelled": 0
    }  # fmt: skip
    assert (status["prompt_tokens"], status["completion_tokens"]) == (8, 4) and status["finished_at"]

    res = cli(redis_url, "results", "b1", "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0
    rows = [orjson.loads(x) for x in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [(r["id"], r["text"], r["finish_reason"]) for r in rows] == [
        ("c1", "answer 0", "eos"),
        ("t1", "answer 1", "length"),
    ]
    assert set(rows[0]) == {
        "id",
        "text",
        "finish_reason",
        "usage",
        "timing",
        "error",
        "metadata",
        "model",
        "cached",
    }
    assert rows[0]["model"] == "smollm2-135m"

    oa = [orjson.loads(x) for x in cli(redis_url, "results", "b1", "--format", "openai").stdout.splitlines()]
    chat, text = (r["response"]["body"] for r in oa)
    assert [r["custom_id"] for r in oa] == ["c1", "t1"] and oa[0]["error"] is None
    assert chat["object"] == "chat.completion" and chat["model"] == "smollm2-135m"  # the model that ran
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "answer 0"}
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["total_tokens"] == 6
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "answer 1"
    assert text["choices"][0]["finish_reason"] == "length"
    assert "b1" in cli(redis_url, "list").stdout


def test_failures_make_wait_exit_4_and_openai_lines_carry_the_error(redis_url: str, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "in.jsonl", {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"})
    assert cli(redis_url, "submit", str(path), "--batch-id", "b2").stdout.strip() == "b2"
    err = Result(
        id="b", index=1, finish_reason="error", error=ErrorInfo(type="prompt_too_long", message="no")
    )
    asyncio.run(finish(redis_url, "b2", [ok(0, "a"), err]))
    assert cli(redis_url, "wait", "b2").returncode == 4
    oa = [orjson.loads(x) for x in cli(redis_url, "results", "b2", "--format", "openai").stdout.splitlines()]
    assert oa[1]["error"] is None and oa[1]["response"]["status_code"] == 400
    assert oa[1]["response"]["body"]["error"] == {
        "message": "no",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "prompt_too_long",
    }


def test_cancel_then_wait_exits_4(redis_url: str, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "x"}, {"prompt": "y"})
    cli(redis_url, "submit", str(path), "--batch-id", "b3")
    out = cli(redis_url, "cancel", "b3")
    assert out.returncode == 0 and "2 queued requests cancelled" in out.stdout
    assert cli(redis_url, "wait", "b3").returncode == 4
    assert orjson.loads(cli(redis_url, "status", "b3", "--json").stdout)["state"] == "cancelled"


def test_stdin_submit_with_wait_writes_results_file(redis_url: str, tmp_path: Path) -> None:
    async def worker() -> None:
        redis = Redis.from_url(redis_url)
        while not await redis.exists(keys.batch_meta("b4")):
            await asyncio.sleep(0.02)
        await redis.aclose()
        await finish(redis_url, "b4", [ok(0, "1")])

    async def main() -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            str(PRODUCER), "submit", "-", "--batch-id", "b4", "--wait", "-o", str(tmp_path / "o.jsonl"),
            "--redis-url", redis_url, stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        (_, err), _ = await asyncio.gather(proc.communicate(b'{"prompt": "x"}\n'), worker())
        return await proc.wait(), err.decode()

    code, err = asyncio.run(main())
    assert code == 0, err
    assert orjson.loads((tmp_path / "o.jsonl").read_bytes())["text"] == "answer 0"


def test_timeouts_and_lengths_are_counted_and_fail_on_makes_wait_exit_5(
    redis_url: str, tmp_path: Path
) -> None:
    """A nightly job checking exit codes must be able to notice partial answers; the summary names every
    finish reason that occurred (issue 58: it dropped `repetition`)."""
    path = jsonl(tmp_path / "in.jsonl", *({"id": f"r{i}", "prompt": "x"} for i in range(5)))
    cli(redis_url, "submit", str(path), "--batch-id", "b5")
    endings = [ok(0, "r0"), ok(1, "r1", "timeout"), ok(2, "r2", "length"), ok(3, "r3", "repetition"),
               ok(4, "r4", "repetition")]  # fmt: skip
    asyncio.run(finish(redis_url, "b5", endings))
    plain = cli(redis_url, "wait", "b5")
    assert plain.returncode == 0
    assert (
        "batch b5 completed: 5 completed, 0 failed, 0 cancelled of 5; "
        "finish reasons: eos 1, length 1, timeout 1, repetition 2" in plain.stderr
    )
    text = cli(redis_url, "status", "b5").stdout
    assert "by finish reason: eos 1, length 1, timeout 1, repetition 2" in text
    assert cli(redis_url, "wait", "b5", "--fail-on", "timeout").returncode == 5
    assert cli(redis_url, "wait", "b5", "--fail-on", "length").returncode == 5
    assert cli(redis_url, "wait", "b5", "--fail-on", "timeout,length").returncode == 5
    bad = cli(redis_url, "wait", "b5", "--fail-on", "eos")
    assert bad.returncode == 2 and "expected timeout, length" in bad.stderr
    status = orjson.loads(cli(redis_url, "status", "b5", "--json").stdout)
    assert (status["completed"], status["timed_out"], status["length"], status["repetition"]) == (5, 1, 1, 2)
    assert (status["eos"], status["stop"]) == (1, 0)
    assert "5  wait: every request has an answer" in cli(redis_url, "wait", "--help").stdout


def test_a_closed_stdout_ends_a_command_quietly(redis_url: str, tmp_path: Path) -> None:
    """`producer list | head -2`: the reader goes away before the command writes; no error, no traceback."""
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "x"})
    for i in range(3):
        cli(redis_url, "submit", str(path), "--batch-id", f"bp{i}")
    asyncio.run(finish(redis_url, "bp0", [ok(0, "1")]))
    for args in (["list"], ["results", "bp0"], ["status", "bp0"]):
        read, write = os.pipe()
        os.close(read)  # the reader has gone
        env = {**os.environ, "REDIS_URL": redis_url}
        proc = subprocess.run(
            [str(PRODUCER), *args], stdout=write, stderr=subprocess.PIPE, env=env, timeout=60, check=False
        )
        os.close(write)
        assert proc.returncode == 141 and proc.stderr == b"", (args, proc.stderr)


def test_reusing_a_batch_id_for_other_content_exits_2_naming_the_line(redis_url: str, tmp_path: Path) -> None:
    day1 = jsonl(tmp_path / "day1.jsonl", {"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"})
    day2 = jsonl(tmp_path / "day2.jsonl", {"id": "a", "prompt": "one"}, {"id": "b", "prompt": "deux"})
    assert cli(redis_url, "submit", str(day1), "--batch-id", "nightly-2026-11-30").returncode == 0
    again = cli(redis_url, "submit", str(day1), "--batch-id", "nightly-2026-11-30")
    assert again.returncode == 0 and "0 enqueued now" in again.stderr
    other = cli(redis_url, "submit", str(day2), "--batch-id", "nightly-2026-11-30")
    assert other.returncode == 2 and other.stdout == ""
    assert "already exists with other content: line 2 (request 2) differs" in other.stderr
