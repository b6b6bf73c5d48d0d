"""Progress display for `producer wait`: a bar redrawn in place on a TTY, plain periodic lines otherwise."""

from __future__ import annotations

import time
from typing import TextIO

from producer.contract import BatchStatus


def _eta(seconds: float | None) -> str:
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
            f"{tok_s:,.0f} tok/s ETA {_eta(eta if s.done < s.total else 0)}"
        )

    def __call__(self, s: BatchStatus) -> None:
        line = self.text(s)
        if self.tty:
            width = 24
            filled = int(width * s.done / s.total) if s.total else width
            self.stream.write(f"\r\x1b[2K[{'#' * filled}{'.' * (width - filled)}] {line}")
        else:
            now = time.monotonic()
            if now - self.last_line < self.line_every_s and s.done < s.total:
                return
            self.last_line = now
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
