"""`producer wait` progress: redrawn in place on a TTY, plain throttled lines in logs."""

from __future__ import annotations

import io
import itertools
import time

from producer.cli.progress import Progress, RateWindow
from producer.wire.results import BatchStatus


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
    ticks = iter([1000.0, 1002.0, 1007.0])  # the rates' clock, however slow the machine
    p = Progress(out, tty=True, clock=lambda: next(ticks))
    p(status(0, 0))
    p(status(2, 100))  # two seconds later: 2 requests and 100 tokens done
    p(status(6, 200))  # five seconds on: 4 more finished, 0.8 a second: the last 4 in 5 s
    p.note("a warning")
    p.finish()
    text = out.getvalue()
    frames = [f for f in text.split("\r\x1b[2K")[1:] if "/10" in f]
    assert len(frames) >= 3 and "\n" not in frames[0]  # each frame overwrites the last, on one line
    second = next(f for f in frames if "2/10 ( 20.0%)" in f)
    assert "50 tok/s" in second and "ETA estimating…" in second  # a first finish is no rate yet
    assert "6/10 ( 60.0%)" in frames[-1] and "ETA 00:05" in frames[-1]
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
    assert r.tok_s == 30.0 and (r.req_s, r.eta(status(5, 600))) == (0.0, None)  # one finish is no rate
    r = w.update(status(2, 650, finished_tokens=120, created_at=now - 5), now + 21)  # a retry: 5 -> 2 done
    assert r.tok_s >= 0 and r.req_s >= 0
    r = w.update(status(4, 700, created_at=now - 5), now + 25)
    assert r.tok_s == 12.5  # measured from the restart
    r = w.update(status(8, 800, created_at=now - 5), now + 30)
    assert (r.req_s, r.eta(status(8, 800))) == (0.8, 2.5)  # 4 finished in the 5 s since the restart's first
    for _ in range(5):  # old samples leave the window
        now += 10
        r = w.update(status(8, 800, created_at=now - 5), now + 30)
    assert r.tok_s == 0.0


def bursty(
    t: float, start: float = 10.0, every: float = 2.0, per: int = 50, total: int = 1000
) -> BatchStatus:
    """A batch of `total` whose worker starts finishing requests at `start` (before that: loading, other
    batches, its first answers), `per` of them together every `every` seconds: done at 48 s."""
    done = 0 if t < start else min(total, per * (int((t - start) // every) + 1))
    return status(done, int(t * 100), total=total, created_at=0.0)


def test_eta_is_the_batchs_own_rate_says_estimating_until_then_and_never_rises_on_schedule() -> None:
    """Issue 58: `producer wait` showed an ETA of 5:56 for a batch that took 40 s, rising while work
    finished: the rate counted the time before the first finish and the gaps between bursts."""
    w = RateWindow()
    out = io.StringIO()
    ticks = iter(k * 0.5 for k in range(200))
    p = Progress(out, tty=False, line_every_s=0, clock=lambda: next(ticks))
    etas = []
    for k in range(97):  # a sample every 0.5 s, as `wait` polls, from its submit to its end
        t = k * 0.5
        s = bursty(t)
        p(s)
        etas.append((t, w.update(s, t).eta(s)))
    shown = [(t, eta) for t, eta in etas if t >= 16]
    assert [eta for _, eta in shown] == [48.0 - t for t, _ in shown]  # the batch's true remaining time
    assert all(b[1] <= a[1] for a, b in itertools.pairwise(shown))  # so it never rises
    # Shown once 3+ requests finished over 5+ seconds (the finishes at 10 s and 16 s); before, none.
    assert all(eta is None for t, eta in etas if t < 16)
    lines = out.getvalue().splitlines()
    assert "ETA estimating\u2026" in lines[0] and "ETA estimating\u2026" in lines[24]  # t = 12: 100 done
    assert "ETA 00:32" in lines[32]  # t = 16


def test_eta_stops_counting_down_when_nothing_finishes_for_longer_than_usual() -> None:
    w = RateWindow()
    for k in range(45):  # finishing on schedule until 22 s (350 done) ...
        r = w.update(bursty(k * 0.5), k * 0.5)
    assert r.eta(bursty(22.0)) == 26.0
    stalled = bursty(22.0)  # ... then nothing more (its worker died)
    etas = [w.update(stalled, 22.0 + k * 0.5).eta(stalled) for k in range(1, 41)]
    assert etas[3] == 24.0  # counted down through the usual 2 s gap
    assert all(b > a for a, b in itertools.pairwise(etas[3:]))  # then the rate falls: the ETA rises
    assert etas[-1] > 26.0  # never 00:00 while nothing finishes
