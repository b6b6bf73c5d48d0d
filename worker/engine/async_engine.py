"""AsyncEngine: the engine's step loop on a background thread, results delivered as asyncio futures.

Model compute never runs on the event loop, so heartbeats, timeouts and signals keep working.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from worker.engine.engine import Engine
from worker.engine.request import EngineRequest, EngineResult

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last_progress = time.monotonic()  # monotonic time of the last completed step (watchdog)
        self._futures: dict[str, asyncio.Future[EngineResult]] = {}
        self._futures_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="batchq-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the loop thread; requests still in flight are cancelled with their partial text."""
        thread = self._thread
        if thread is None:
            return
        with self._futures_lock:
            pending = list(self._futures)
        for rid in pending:
            self.engine.cancel(rid)
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(thread.join)
        self._thread = None

    def submit(self, req: EngineRequest) -> asyncio.Future[EngineResult]:
        """Queue a request; the returned future resolves with its one EngineResult."""
        loop = self._loop or asyncio.get_running_loop()
        fut: asyncio.Future[EngineResult] = loop.create_future()
        with self._futures_lock:
            if req.request_id in self._futures:
                raise ValueError(f"request id {req.request_id!r} is already in flight")
            self._futures[req.request_id] = fut
        self.engine.add_request(req)
        self._wake.set()
        return fut

    def cancel(self, request_id: str) -> None:
        """End the request at its next step with finish_reason "cancelled" and its partial text."""
        self.engine.cancel(request_id)
        self._wake.set()

    # ---- loop thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                if self._stopping:
                    return
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                results = self.engine.step()
            except Exception as exc:  # never let one bad step kill the loop: fail what it held
                log.exception("engine step failed; failing every request in flight")
                results = self.engine.abort_all("engine_error", f"{type(exc).__name__}: {exc}")
            self.last_progress = time.monotonic()
            if results:
                self._deliver(results)

    def _deliver(self, results: list[EngineResult]) -> None:
        with self._futures_lock:
            pairs = [(self._futures.pop(r.request_id, None), r) for r in results]
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for fut, res in pairs:
            if fut is not None:
                loop.call_soon_threadsafe(_set_result, fut, res)


def _set_result(fut: asyncio.Future[EngineResult], res: EngineResult) -> None:
    if not fut.done():  # the awaiting task may have been cancelled
        fut.set_result(res)
