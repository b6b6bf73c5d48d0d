"""Heartbeat key, periodic stats line, stall watchdog, the metrics port's /health and `worker --check`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from pydantic import ValidationError
from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.workers import Heartbeat
from worker.config import WorkerConfig
from worker.engine.async_engine import AsyncEngine

log = logging.getLogger("batchq.worker")


def _package_version() -> str:
    try:
        return importlib.metadata.version("batchq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _package_version()


@dataclass(frozen=True)
class EngineFacts:
    """What an engine runs on, fixed at load: heartbeats and the metrics' info carry it."""

    device: str  # "cpu", "cuda:0"; a tensor-parallel group's "cuda x4" (rank 0's device type, the ranks)
    dtype: str  # compute dtype
    kv_cache_dtype: str
    attention: str  # the attention backend
    block_size: int

    @classmethod
    def of(cls, engine: AsyncEngine) -> EngineFacts:
        runner = engine.core.model_runner
        cfg = getattr(engine.core, "cfg", None)  # (the stand-in engine has no settings)
        ranks = 1 if cfg is None else cfg.tensor_parallel_size
        return cls(
            device=str(runner.device) if ranks == 1 else f"{runner.device.type} x{ranks}",
            dtype=str(runner.model.dtype).removeprefix("torch."),
            kv_cache_dtype=str(runner.kv_caches[0][0].dtype).removeprefix("torch."),
            attention=runner.backend.name,
            block_size=runner.block_size,
        )


class Heartbeats:
    """Writes the worker's heartbeat (producer/wire/workers.py's Heartbeat) with its throughput since the
    last one."""

    def __init__(self, cfg: WorkerConfig, engine: AsyncEngine, metrics_port: int | None = None) -> None:
        self.cfg, self.engine, self.metrics_port = cfg, engine, metrics_port
        self.facts = EngineFacts.of(engine)
        self.started_at = time.time()
        self._t, self._tokens = time.monotonic(), engine.core.stats().tokens_generated

    def snapshot(self) -> Heartbeat:
        s = self.engine.core.stats()
        now = time.monotonic()
        tok_s = (s.tokens_generated - self._tokens) / max(now - self._t, 1e-9)
        self._t, self._tokens = now, s.tokens_generated
        return Heartbeat(
            worker_id=self.cfg.worker_id,
            host=socket.gethostname(),
            queue=keys.queue_name(self.cfg.queue),
            model=self.cfg.engine.model,
            ts=time.time(),
            running=s.running,
            waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            tokens_generated=s.tokens_generated,
            progress_age_s=round(now - self.engine.last_progress, 3),
            stall_s=self.cfg.stall_s,
            version=VERSION,
            device=self.facts.device,
            dtype=self.facts.dtype,
            kv_cache_dtype=self.facts.kv_cache_dtype,
            tok_s=round(tok_s, 1),
            started_at=self.started_at,
            metrics_port=self.metrics_port,
            loras=[] if self.engine.core.loras is None else self.engine.core.loras.resident(),
        )

    async def beat(self, redis: Redis) -> None:
        snap = self.snapshot()
        ttl = max(1, int(self.cfg.heartbeat_s * 3))
        async with redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.worker_heartbeat(self.cfg.worker_id), snap.model_dump_json(), ex=ttl)
            pipe.zadd(keys.WORKERS, {self.cfg.worker_id: snap.ts})
            await pipe.execute()


class StatsLogger:
    """One line per interval: throughput, running and waiting counts, KV pool use. Never prompts."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._t = time.monotonic()
        s = engine.core.stats()
        self._tokens, self._steps, self._prefills = s.tokens_generated, s.steps, s.prefill_steps
        self._busy = s.prefill_s + s.decode_s + s.score_s
        self._prompt, self._cached = s.prompt_tokens, s.cached_prompt_tokens
        self._preempted = s.preemptions
        self._window_released = s.window_released_blocks

    def line(self, completed: int, failed: int, from_cache: int) -> str:
        s = self.engine.core.stats()
        now = time.monotonic()
        rate = (s.tokens_generated - self._tokens) / max(now - self._t, 1e-9)
        busy = s.prefill_s + s.decode_s + s.score_s
        # model busy = share of the interval spent inside forward passes (the rest: scheduling, stop
        # rules, detokenising, waiting for work, and whatever else competes for the CPU)
        busy_pct = 100.0 * (busy - self._busy) / max(now - self._t, 1e-9)
        steps, prefills = s.steps - self._steps, s.prefill_steps - self._prefills
        cached = s.cached_prompt_tokens - self._cached
        computed = s.prompt_tokens - self._prompt - cached
        preempted = s.preemptions - self._preempted
        self._t, self._tokens, self._steps, self._prefills, self._busy = (
            now,
            s.tokens_generated,
            s.steps,
            s.prefill_steps,
            busy,
        )
        self._prompt, self._cached = s.prompt_tokens, s.cached_prompt_tokens
        self._preempted = s.preemptions
        released, self._window_released = (
            s.window_released_blocks - self._window_released,
            s.window_released_blocks,
        )
        kv_pct = 100.0 * s.kv_blocks_used / max(s.kv_blocks_total, 1)
        # a sliding window's effect on the pool, where the model has one: blocks it released (every layer
        # windowed) or blocks only full-attention layers still read (windowed and full layers)
        window = f"window released={released} " if s.window_released_blocks else ""
        window += f"window idle={s.window_idle_blocks} " if s.window_idle_blocks else ""
        return (
            f"throughput={rate:.1f} tok/s running={s.running} waiting={s.waiting} "
            f"kv={s.kv_blocks_used}/{s.kv_blocks_total} ({kv_pct:.0f}%) {window}steps={steps} "
            f"(prefill {prefills}) prompt tokens computed={computed} cached={cached} preempted={preempted} "
            f"model busy={busy_pct:.0f}% done={completed} (result cache {from_cache}) failed={failed}"
        )


def start_watchdog(engine: AsyncEngine, stall_s: float) -> threading.Thread:
    """End the process (status 70) when the engine has work but makes no progress for stall_s.

    A thread, not a task: it must fire even if the event loop itself is stuck.
    """

    def watch() -> None:
        while True:
            time.sleep(min(1.0, stall_s / 4))
            idle = time.monotonic() - engine.last_progress
            if engine.core.has_work() and idle > stall_s:
                log.error("engine made no progress for %.0fs (stall_s=%.0f): exiting", idle, stall_s)
                logging.shutdown()
                os._exit(70)

    t = threading.Thread(target=watch, name="batchq-watchdog", daemon=True)
    t.start()
    return t


class Liveness:
    """What GET /health on the metrics port answers: Kubernetes' startup, readiness and liveness probes.

    It is read from this process alone, never from Redis: in a Redis outage workers wait and reconnect
    by themselves, and a probe that failed with Redis would have Kubernetes restart every worker at once
    (and reload every model). `worker --check`, which reads the heartbeats in Redis, stays the probe of
    docker compose and of an operator's shell. The server starts once the model is loaded, so a startup
    probe on /health waits out the load.
    """

    def __init__(self, engine: AsyncEngine, stall_s: float) -> None:
        self.engine, self.stall_s = engine, stall_s
        self.pulse = time.monotonic()

    async def beat(self) -> None:
        """The event loop's pulse: the watchdog sees a stuck engine, this a stuck loop (no claims, no
        lease renewals, no writes)."""
        while True:
            self.pulse = time.monotonic()
            await asyncio.sleep(1.0)

    def report(self) -> tuple[bool, dict[str, object]]:
        """(healthy, the JSON body): unhealthy when the engine has work and has made no progress for
        stall_s (the watchdog exits soon after), or the event loop has not run for as long."""
        now = time.monotonic()
        progress_age, loop_age = now - self.engine.last_progress, now - self.pulse
        body: dict[str, object] = {"progress_age_s": round(progress_age, 1), "loop_age_s": round(loop_age, 1)}
        if self.engine.core.has_work() and progress_age > self.stall_s:
            return False, {"status": "engine stalled", **body}
        if loop_age > self.stall_s:
            return False, {"status": "event loop stalled", **body}
        return True, {"status": "ok", **body}


async def check(redis: Redis, queue: str, worker_id: str | None) -> tuple[bool, str]:
    """Healthy when a live heartbeat exists (this host's workers on `queue`, or `worker_id`) and is not stalled."""
    host = socket.gethostname()
    candidates = [worker_id] if worker_id else [m.decode() for m in await redis.zrange(keys.WORKERS, 0, -1)]
    qname = keys.queue_name(queue)
    for wid in candidates:
        raw = await redis.get(keys.worker_heartbeat(wid))
        if raw is None:
            continue
        try:
            snap = Heartbeat.model_validate_json(raw)
        except ValidationError:
            continue
        if worker_id is None and (snap.host != host or snap.queue != qname):
            continue
        if snap.stalled():
            return False, f"worker {wid} is stalled ({snap.progress_age_s:.0f}s without progress)"
        return True, f"worker {wid} healthy: running={snap.running} waiting={snap.waiting}"
    return False, f"no live worker heartbeat for queue {qname!r}" + (
        f" and id {worker_id!r}" if worker_id else ""
    )
