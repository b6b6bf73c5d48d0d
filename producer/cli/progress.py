"""Progress display for `producer wait`: rich's bar redrawn in place on a TTY, plain periodic lines otherwise."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, TaskID, TextColumn
from rich.progress import Progress as RichProgress

from producer.wire.results import BatchStatus


def eta_text(seconds: float | None, unknown: str = "--:--") -> str:
    """h:mm:ss or mm:ss; `unknown` where there is no estimate yet."""
    if seconds is None:
        return unknown
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


ESTIMATING = "estimating\u2026"  # what `producer wait` shows for the ETA until there is one
RATE_WINDOW_S = 30.0  # a batch's rates are measured over this much of the reader's own samples
ETA_MIN_DONE = 3  # the ETA waits for this many requests to finish within the reader's samples ...
ETA_MIN_SPAN_S = 5.0  # ... spread over at least this many seconds (first to last of those finishes)


@dataclass(frozen=True)
class BatchRate:
    tok_s: float  # tokens generated per second (running requests included)
    req_s: float  # requests finished per second, between finishes the reader saw (0.0: not measured yet)
    eta_s: float | None = None  # seconds left as of the sample (RateWindow.update); None: not estimated yet

    def eta(self, s: BatchStatus) -> float | None:
        """Seconds until the batch is done: 0 once it is; None until the rate is measured."""
        return 0.0 if s.done >= s.total else self.eta_s


class RateWindow:
    """One batch's rates over the last RATE_WINDOW_S of samples of its own counters: `tokens_generated`
    (which workers add to while requests run, so a batch of long generations shows its rate before any
    request ends) and the finished requests. A counter that goes down (a retry took results back into
    the queue) restarts the window, so rates are never negative. Until two samples are a second apart,
    tok/s is the batch's average since it was created (a one-shot snapshot shows that).

    The ETA is the batch's remaining requests at its own completion rate, measured between finishes: from
    the first sample at which more requests had finished to the last such sample in the window, never
    from the batch's creation nor from samples before its first finish (the time a worker spent loading, or
    on other batches, or generating the first answers is not a rate) nor across the gap since the last
    finish (requests finish in bursts, so a rate that counted the gap would fall, and the ETA rise, between
    bursts while the batch is on schedule). The estimate counts down from the last finish (remaining /
    rate - the time since) for as long as the usual gap between finishes; a gap longer than that is
    counted into the rate (the batch is slower than measured), so the ETA rises only while nothing
    finishes for longer than usual. None (`producer wait`: "estimating…") until
    ETA_MIN_DONE requests finished over ETA_MIN_SPAN_S or more."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()
        self.finishes: deque[tuple[float, int]] = deque()  # (time, done) of the samples where done rose
        self.restarted = False

    def update(self, s: BatchStatus, now: float | None = None) -> BatchRate:
        now = time.time() if now is None else now
        q = self.samples
        if q and (s.done < q[-1][1] or s.tokens_generated < q[-1][2]):
            q.clear()
            self.finishes.clear()
            self.restarted = True
        if q and s.done > q[-1][1]:
            self.finishes.append((now, s.done))
        q.append((now, s.done, s.tokens_generated))
        while now - q[0][0] > self.window_s and len(q) > 2:
            q.popleft()
        req_s, eta = self._eta(s, now)
        t0, tok0 = q[0][0], q[0][2]
        if now - t0 < 1.0:
            if self.restarted:
                return BatchRate(0.0, req_s, eta)
            t0, tok0 = s.created_at, 0
        tok_s = max(0.0, (s.tokens_generated - tok0) / max(now - t0, 1e-6))
        return BatchRate(tok_s=tok_s, req_s=req_s, eta_s=eta)

    def _eta(self, s: BatchStatus, now: float) -> tuple[float, float | None]:
        """(requests per second, seconds left) from the finishes in the window; (0.0, None) until measured."""
        f = self.finishes
        # The window keeps the newest finish at or before its start (so the rate spans it all) and never
        # fewer than ETA_MIN_DONE finished requests (a slow batch's rate spans as long as it takes).
        while len(f) > 2 and now - f[1][0] >= self.window_s and f[-1][1] - f[1][1] >= ETA_MIN_DONE:
            f.popleft()
        if s.done >= s.total:
            return 0.0, 0.0
        if len(f) < 2:
            return 0.0, None
        (t0, d0), (t1, d1) = f[0], f[-1]
        if d1 - d0 < ETA_MIN_DONE or t1 - t0 < ETA_MIN_SPAN_S:
            return 0.0, None
        left, gap = s.total - s.done, now - t1
        usual_gap = (t1 - t0) / (len(f) - 1)  # between the samples at which more had finished
        late = max(0.0, gap - usual_gap)  # nothing finished for longer than usual: the rate is lower
        eta = left * (t1 - t0 + late) / (d1 - d0) - min(gap, usual_gap)
        return (d1 - d0) / (t1 - t0 + late), max(0.0, eta)


class Progress:
    def __init__(
        self,
        stream: TextIO,
        *,
        tty: bool | None = None,
        line_every_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stream = stream
        self.clock = clock  # the rates' wall clock
        self.tty = stream.isatty() if tty is None else tty
        self.line_every_s = line_every_s
        self.rates = RateWindow()
        self.last_line = float("-inf")
        self.bar: RichProgress | None = None
        self.task: TaskID | None = None
        if self.tty:
            console = Console(file=stream, force_terminal=True)
            columns = (BarColumn(bar_width=24), TextColumn("{task.fields[line]}"))
            self.bar = RichProgress(*columns, console=console, auto_refresh=False)

    def text(self, s: BatchStatus) -> str:
        rate = self.rates.update(s, self.clock())
        eta = rate.eta(s)
        pct = 100.0 * s.done / s.total if s.total else 100.0
        extra = f" failed={s.failed}" if s.failed else ""
        extra += f" cancelled={s.cancelled}" if s.cancelled else ""
        extra += f" timed_out={s.timed_out}" if s.timed_out else ""
        return (
            f"{s.done}/{s.total} ({pct:5.1f}%) running={s.running}{extra} "
            f"{rate.tok_s:,.0f} tok/s ETA {eta_text(eta, ESTIMATING)}"
        )

    def __call__(self, s: BatchStatus) -> None:
        line = self.text(s)
        if self.bar is not None:
            total, done = (s.total, s.done) if s.total else (1, 1)
            if self.task is None:
                self.task = self.bar.add_task("", total=total, completed=done, line=line)
                self.bar.start()  # draws the first frame
            else:
                self.bar.update(self.task, total=total, completed=done, line=line)
                self.bar.refresh()
            return
        now = time.monotonic()
        if now - self.last_line < self.line_every_s and s.done < s.total:
            return
        self.last_line = now
        self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        """A line of its own (a warning), printed above the bar on a TTY."""
        if self.bar is not None:
            self.bar.console.print(message, markup=False, highlight=False)
        else:
            self.stream.write(message + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.bar is not None and self.bar.live.is_started:
            self.bar.stop()
