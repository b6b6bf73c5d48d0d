"""`producer wait` progress: redrawn in place on a TTY, plain throttled lines in logs."""

from __future__ import annotations

import io

from producer.contract import BatchStatus
from producer.progress import Progress


def status(done: int, tokens: int, total: int = 10) -> BatchStatus:
    return BatchStatus(
        batch_id="b", state="running", total=total, queued=total - done, running=0, completed=done,
        failed=0, cancelled=0, prompt_tokens=0, completion_tokens=tokens, created_at=0.0,
    )  # fmt: skip


def test_tty_bar_is_redrawn_in_place_with_done_total_rate_and_eta() -> None:
    out = io.StringIO()
    p = Progress(out, tty=True)
    p(status(0, 0))
    p.t0 -= 2.0  # two seconds later: 4 requests and 100 tokens done
    p(status(4, 100))
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
