"""`producer workers` and `producer top`: live workers (from their heartbeats) and active batches, with rich.

`top` redraws every second on a terminal until Ctrl-C; anywhere else (a pipe, a log) it prints one
snapshot and exits, as `--once` does.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from producer.cli.progress import BatchRate, RateWindow, eta_text
from producer.client.batchq_client import BatchqClient
from producer.wire.results import BatchStatus
from producer.wire.workers import Heartbeat, queue_label

ACTIVE = ("queued", "running")


def _console() -> Console:
    """A console for stdout; off a terminal, wide enough that tables do not wrap in a log file."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 200))


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}{'' if n == 1 else plural}"


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def workers_table(workers: list[Heartbeat], now: float) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title="workers", title_justify="left", show_edge=False, pad_edge=False)
    for name in ("WORKER", "HOST", "MODEL", "DEVICE", "DTYPE", "QUEUE"):
        t.add_column(name, overflow="fold")
    for name in ("TOK/S", "RUN/WAIT", "KV %", "BEAT", "VERSION"):
        t.add_column(name, justify="right")
    for w in workers:
        state = Text(_age(w.age_s(now)), style="red" if w.stalled() else "")
        t.add_row(
            w.worker_id, w.host, w.model_and_adapters, w.device, w.dtype, queue_label(w.queue), f"{w.tok_s:,.1f}",
            f"{w.running}/{w.waiting}", f"{w.kv_pct:.0f}", state, w.version,
        )  # fmt: skip
    return t


class BatchRates:
    """Per batch, its RateWindow over top's own samples (producer/cli/progress.py)."""

    def __init__(self) -> None:
        self.windows: dict[str, RateWindow] = {}

    def update(self, s: BatchStatus, now: float) -> BatchRate:
        return self.windows.setdefault(s.batch_id, RateWindow()).update(s, now)

    def forget_all_but(self, batch_ids: set[str]) -> None:
        for b in set(self.windows) - batch_ids:
            del self.windows[b]


def batches_table(batches: list[BatchStatus], rates: BatchRates, now: float) -> Table:
    t = Table(
        box=box.SIMPLE_HEAD, title="active batches", title_justify="left", show_edge=False, pad_edge=False
    )
    t.add_column("BATCH", overflow="fold")
    t.add_column("QUEUE")
    t.add_column("PROGRESS", width=22)
    for name in ("DONE", "RUNNING", "FAILED", "TOK/S", "ETA", "AGE"):
        t.add_column(name, justify="right")
    for s in batches:
        r = rates.update(s, now)
        pct = 100.0 * s.done / s.total if s.total else 100.0
        failed = Text(str(s.failed + s.cancelled), style="red" if s.failed else "")
        t.add_row(
            s.batch_id, queue_label(s.queue), ProgressBar(total=max(s.total, 1), completed=s.done, width=22),
            f"{s.done}/{s.total} {pct:.0f}%", str(s.running), failed, f"{r.tok_s:,.0f}", eta_text(r.eta(s)),
            _age(now - s.created_at),
        )  # fmt: skip
    rates.forget_all_but({s.batch_id for s in batches})
    return t


class TopView:
    def __init__(self, client: BatchqClient, limit: int) -> None:
        self.client, self.limit = client, limit
        self.rates = BatchRates()

    async def render(self) -> RenderableType:
        workers = await self.client.workers()
        batches = [s for s in await self.client.list_batches(self.limit) if s.state in ACTIVE]
        now = time.time()
        head = Text(
            f"batchq top  {time.strftime('%H:%M:%S')}  {_count(len(workers), 'live worker')}, "
            f"{_count(len(batches), 'active batch', 'es')}"
        )
        parts: list[RenderableType] = [head]
        parts.append(workers_table(workers, now) if workers else Text("no live workers", style="yellow"))
        parts.append(batches_table(batches, self.rates, now) if batches else Text("no active batches"))
        return Group(*parts)


async def workers(client: BatchqClient, args: argparse.Namespace) -> int:
    live = await client.workers(args.queue)
    now = time.time()
    if args.json:
        for w in live:
            print(orjson.dumps(w.to_row(now)).decode())
        return 0
    if not live:
        print("no live workers (no worker heartbeat in this Redis)")
        return 0
    _console().print(workers_table(live, now))
    return 0


async def top(client: BatchqClient, args: argparse.Namespace) -> int:
    view = TopView(client, args.limit)
    console = Console()
    if args.once or not console.is_terminal:
        _console().print(await view.render())
        return 0
    try:
        with Live(await view.render(), console=console, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(args.interval)
                live.update(await view.render(), refresh=True)
    except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C: asyncio.run cancels this task
        pass
    return 0
