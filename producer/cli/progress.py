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

from producer.wire.contract import BatchStatus


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


RATE_WINDOW_S = 30.0  # a batch's rates are measured over this much of the reader's own samples


@dataclass(frozen=True)
class BatchRate:
    tok_s: float  # tokens generated per second (running requests included)
    req_s: float  # requests finished per second

    def eta(self, s: BatchStatus) -> float | None:
        """Seconds until the batch is done at this rate; None until a request has finished in the window."""
        if s.done >= s.total:
            return 0.0
        return (s.total - s.done) / self.req_s if self.req_s > 0 else None


class RateWindow:
    """One batch's rates over the last RATE_WINDOW_S of samples of its own counters: `tokens_generated`
    (which workers add to while requests run, so a batch of long generations shows its rate before any
    request ends) and the finished requests. A counter that goes down (a retry took results back into
    the queue) restarts the window, so rates are never negative. Until two samples are a second apart,
    the rates are the batch's averages since it was created (a one-shot snapshot shows those)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()
        self.restarted = False

    def update(self, s: BatchStatus, now: float | None = None) -> BatchRate:
        now = time.time() if now is None else now
        q = self.samples
        if q and (s.done < q[-1][1] or s.tokens_generated < q[-1][2]):
            q.clear()
            self.restarted = True
        q.append((now, s.done, s.tokens_generated))
        while now - q[0][0] > self.window_s and len(q) > 2:
            q.popleft()
        t0, done0, tok0 = q[0]
        if now - t0 < 1.0:
            if self.restarted:
                return BatchRate(0.0, 0.0)
            t0, done0, tok0 = s.created_at, 0, 0
        span = max(now - t0, 1e-6)
        return BatchRate(
            tok_s=max(0.0, (s.tokens_generated - tok0) / span), req_s=max(0.0, (s.done - done0) / span)
        )


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
            f"{rate.tok_s:,.0f} tok/s ETA {eta_text(eta)}"
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
