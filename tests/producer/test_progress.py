"""`producer wait` progress: redrawn in place on a TTY, plain throttled lines in logs."""

from __future__ import annotations

import io
import time

from producer.cli.progress import Progress, RateWindow
from producer.wire.contract import BatchStatus


def status(
    done: int, tokens: int, total: int = 10, finished_tokens: int = 0, created_at: float = 0.0
) -> BatchStatus:
    """`tokens`: generated so far (running requests included); `finished_tokens`: of finished requests."""
    return BatchStatus(
        batch_id="b", state="running", total=total, queued=total - done, running=0, completed=done,
        failed=0, cancelled=0, prompt_tokens=0, completion_tokens=finished_tokens, tokens_generated=tokens,
        created_at=created_at,
    )  # fmt: skip


def test_tty_bar_is_redrawn_in_place_with_done_total_rate_and_eta() -> None:
    out = io.StringIO()
    ticks = iter([1000.0, 1002.0])  # the rates' clock: two seconds apart, however slow the machine
    p = Progress(out, tty=True, clock=lambda: next(ticks))
    p(status(0, 0))
    p(status(4, 100))  # two seconds later: 4 requests and 100 tokens done
    p.note("a warning")
    p.finish()
    text = out.getvalue()
    frames = [f for f in text.split("\r\x1b[2K")[1:] if "/10" in f]
    assert len(frames) >= 2 and "\n" not in frames[0]  # each frame overwrites the last, on one line
    assert "4/10 ( 40.0%)" in frames[-1] and "50 tok/s" in frames[-1] and "ETA 00:03" in frames[-1]
    assert "━" in frames[-1]  # rich's bar
    assert "a warning\n" in text  # printed above the bar, not through it
    assert text.endswith("\x1b[?25h")  # finish() leaves the line and shows the cursor again


def test_non_tty_prints_plain_lines_at_most_every_interval_and_always_the_last() -> None:
    out = io.StringIO()
    p = Progress(out, tty=False, line_every_s=60)
    p(status(1, 5))
    p(status(2, 9))  # within the interval: not printed
    p(status(10, 50))  # finished: always printed
    lines = out.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["1/10", "10/10"]
    assert "\r" not in out.getvalue()


def test_rates_come_from_tokens_generated_while_requests_run_and_never_go_negative() -> None:
    """Long generations: no request has finished, yet tokens flow (a worker reports them as they come);
    then a retry takes results back into the queue: the rates restart, they do not go below zero."""
    w = RateWindow(window_s=30)
    now = time.time()
    w.update(status(0, 0, created_at=now - 5), now)
    r = w.update(status(0, 480, created_at=now - 5), now + 10)
    assert r.tok_s == 48.0 and r.req_s == 0.0 and r.eta(status(0, 480)) is None  # no ETA from nothing
    r = w.update(status(5, 600, finished_tokens=300, created_at=now - 5), now + 20)
    assert r.tok_s == 30.0 and r.req_s == 0.25 and r.eta(status(5, 600)) == 20.0
    r = w.update(status(2, 650, finished_tokens=120, created_at=now - 5), now + 21)  # a retry: 5 -> 2 done
    assert r.tok_s >= 0 and r.req_s >= 0
    r = w.update(status(4, 700, created_at=now - 5), now + 25)
    assert (r.tok_s, r.req_s) == (12.5, 0.5)  # measured from the restart
    for _ in range(5):  # old samples leave the window
        now += 10
        r = w.update(status(4, 700, created_at=now - 5), now + 25)
    assert (r.tok_s, r.req_s) == (0.0, 0.0)
