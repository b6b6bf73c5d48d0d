"""Progress display for `producer wait`: rich's bar redrawn in place on a TTY, plain periodic lines otherwise."""

from __future__ import annotations

import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, TaskID, TextColumn
from rich.progress import Progress as RichProgress

from producer.contract import BatchStatus


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, stream: TextIO, *, tty: bool | None = None, line_every_s: float = 10.0) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.line_every_s = line_every_s
        self.t0 = time.monotonic()
        self.done0: int | None = None
        self.tokens0 = 0
        self.last_line = float("-inf")
        self.bar: RichProgress | None = None
        self.task: TaskID | None = None
        if self.tty:
            console = Console(file=stream, force_terminal=True)
            columns = (BarColumn(bar_width=24), TextColumn("{task.fields[line]}"))
            self.bar = RichProgress(*columns, console=console, auto_refresh=False)

    def text(self, s: BatchStatus) -> str:
        elapsed = max(1e-6, time.monotonic() - self.t0)
        if self.done0 is None:
            self.done0, self.tokens0 = s.done, s.completion_tokens
        tok_s = (s.completion_tokens - self.tokens0) / elapsed
        rate = (s.done - self.done0) / elapsed
        eta = (s.total - s.done) / rate if rate > 0 else None
        pct = 100.0 * s.done / s.total if s.total else 100.0
        extra = f" failed={s.failed}" if s.failed else ""
        extra += f" cancelled={s.cancelled}" if s.cancelled else ""
        return (
            f"{s.done}/{s.total} ({pct:5.1f}%) running={s.running}{extra} "
            f"{tok_s:,.0f} tok/s ETA {eta_text(eta if s.done < s.total else 0)}"
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
