"""AsyncEngine: the engine's step loop on a background thread, results delivered as asyncio futures.

Model compute never runs on the event loop, so heartbeats, timeouts and signals keep working.

Every torch call of a process should come from one thread: each thread that runs a parallel op gets
its own OpenMP team, and an idle team's spinning workers then compete with the busy one for the cores
(a model loaded and warmed up on one thread and stepped on another decodes markedly slower).
`AsyncEngine.load` therefore loads the model on the engine thread itself, which then runs the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from worker.engine.engine import Engine
from worker.engine.request import EngineError, EngineRequest, EngineResult
from worker.engine_config import EngineConfig
from worker.parallel.group import GroupFailure
from worker.platform.cpu_settings import one_malloc_arena

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, core: Engine) -> None:
        self.core = core  # the synchronous engine this class steps on its thread
        self.last_progress = time.monotonic()  # monotonic time of the last completed step (watchdog)
        self._futures: dict[str, asyncio.Future[EngineResult]] = {}
        self._futures_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # An engine that cannot go on (its tensor-parallel group lost a rank): the loop ends, every request's
        # future fails with this, and `on_fatal` runs on the loop thread (the worker exits there, leaving its
        # leased requests to run elsewhere rather than answering them with errors).
        self.fatal: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None

    @classmethod
    async def load(
        cls, cfg: EngineConfig, loader: Callable[[EngineConfig], Engine] = Engine.load
    ) -> AsyncEngine:
        """Load the engine on its own step thread and start the loop there (see the module docstring)."""
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[AsyncEngine] = loop.create_future()

        def run() -> None:
            try:
                self = cls(loader(cfg))
            except BaseException as exc:  # the caller sees the load error; the thread ends
                loop.call_soon_threadsafe(_set_exception, loaded, exc)
                return
            self._loop, self._thread = loop, threading.current_thread()
            loop.call_soon_threadsafe(_set_result, loaded, self)
            self._run()

        one_malloc_arena()  # before the thread's first allocation (cpu_settings says why)
        threading.Thread(target=run, name="batchq-engine", daemon=True).start()
        return await loaded

    async def stop(self) -> None:
        """Stop the loop thread; requests still in flight are cancelled with their partial text."""
        thread = self._thread
        if thread is None:
            return
        with self._futures_lock:
            pending = list(self._futures)
        for rid in pending:
            self.core.cancel(rid)
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(thread.join)
        self._thread = None
        close = getattr(self.core, "close", None)  # a tensor-parallel group's ranks (not the stand-in's)
        if close is not None:
            await asyncio.to_thread(close)

    def submit(self, req: EngineRequest) -> asyncio.Future[EngineResult]:
        """Queue a request; the returned future resolves with its one EngineResult."""
        loop = self._loop or asyncio.get_running_loop()
        fut: asyncio.Future[EngineResult] = loop.create_future()
        if self.fatal is not None:
            fut.set_exception(self.fatal)
            return fut
        with self._futures_lock:
            if req.request_id in self._futures:
                raise ValueError(f"request id {req.request_id!r} is already in flight")
            self._futures[req.request_id] = fut
        self.core.add_request(req)
        self._wake.set()
        return fut

    def generated_tokens(self) -> dict[str, int]:
        """Tokens generated so far by each running request (read from the loop thread's sequences: a
        count may lag a step behind, never runs ahead). An n > 1 request counts its running samples."""
        counts: dict[str, int] = {}
        for seq in list(self.core.scheduler.running):
            rid = seq.group or seq.request_id
            counts[rid] = counts.get(rid, 0) + len(seq.output_ids)
        return counts

    def cancel(self, request_id: str) -> None:
        """End the request at its next step with finish_reason "cancelled" and its partial text."""
        self.core.cancel(request_id)
        self._wake.set()

    # ---- loop thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            failure = getattr(self.core, "failure", None)  # (the stand-in engine has none)
            if failure is not None and (why := failure()) is not None:
                self._fail(GroupFailure(why))
                return
            if not self.core.has_work():
                if self._stopping:
                    return
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                results = self.core.step()
            except GroupFailure as exc:
                self._fail(exc)
                return
            except Exception as exc:  # never let one bad step kill the loop: fail what it held
                log.exception("engine step failed; failing every request in flight")
                results = self.core.abort_all(EngineError("engine_error", f"{type(exc).__name__}: {exc}"))
            self.last_progress = time.monotonic()
            if results:
                self._deliver(results)

    def _fail(self, exc: BaseException) -> None:
        """The engine cannot go on: every request's future fails with `exc`, then `on_fatal` runs."""
        log.critical("the engine cannot go on: %s", exc)
        self.fatal = exc
        with self._futures_lock:
            pending, self._futures = list(self._futures.values()), {}
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for fut in pending:
                loop.call_soon_threadsafe(_set_exception, fut, exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _deliver(self, results: list[EngineResult]) -> None:
        with self._futures_lock:
            pairs = [(self._futures.pop(r.request_id, None), r) for r in results]
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for fut, res in pairs:
            if fut is not None:
                loop.call_soon_threadsafe(_set_result, fut, res)


def _set_result(fut: asyncio.Future[T], res: T) -> None:
    if not fut.done():  # the awaiting task may have been cancelled
        fut.set_result(res)


def _set_exception(fut: asyncio.Future[T], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
