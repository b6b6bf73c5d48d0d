"""Async scheduling's decode steps in flight: launched on a device thread and taken a step later, while the
engine schedules and launches the next one behind them (Engine.step says when a step may overlap)."""

from __future__ import annotations

import contextlib
import operator
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.step_io import DecodeDone

_FAST = operator.attrgetter("fast")
_PREFILLED = operator.attrgetter("prefilled")


def may_overlap(scheduler: Scheduler) -> bool:
    """Whether the next step may be launched before the one in flight is taken: every running sequence
    prefilled and plain (Sequence.fast: nothing of its next step but the input token depends on this
    one's), and none waiting that could be admitted."""
    running = scheduler.running
    return (
        bool(running)
        and all(map(_FAST, running))
        and all(map(_PREFILLED, running))
        and scheduler.admission_closed()
    )


class InFlight:
    """The decode steps launched and not yet taken, oldest first, each with the engine's count of finished
    sequences when it was launched (a step taken after some ended keeps only the others' tokens)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: deque[tuple[ScheduledBatch, Future[DecodeDone], int]] = deque()
        self._device: ThreadPoolExecutor | None = None

    def __bool__(self) -> bool:
        return bool(self.steps)

    def launch(self, batch: ScheduledBatch, finished: int) -> bool:
        """Launch a decode step of plain sequences on the device thread, behind the one in flight (its input
        tokens are that one's, taken on the device); -> whether it overlaps one."""
        if self._device is None:
            self._device = ThreadPoolExecutor(1, thread_name_prefix="batchq-device")
        previous = self.steps[-1][1] if self.steps else None
        work = self.runner.launch_decode(batch, previous)
        for i, seq in enumerate(batch.seqs):
            seq.inflight += 1
            seq.inflight_row = i
        self.steps.append((batch, self._device.submit(work), finished))
        return previous is not None

    def take(self) -> tuple[ScheduledBatch, list[int], float, int]:
        """The oldest step, done: (its batch, its tokens, its device seconds, the finished count at launch)."""
        batch, future, finished = self.steps.popleft()
        try:
            done = future.result()
        finally:
            for seq in batch.seqs:
                seq.inflight -= 1
        return batch, done.token_list(), done.seconds, finished

    def drain(self) -> None:
        """Wait for the launched steps and forget them, their tokens unseen (the engine is failing them)."""
        while self.steps:
            batch, future, _ = self.steps.popleft()
            with contextlib.suppress(Exception):  # (the caller is failing everything already)
                future.result()
            for seq in batch.seqs:
                seq.inflight -= 1
