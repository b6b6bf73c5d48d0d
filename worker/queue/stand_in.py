"""An engine stand-in that answers every request at once, without a model: the queue path alone.

For benchmarks and tests only (`worker --engine-stand-in`, benchmarks/queue_bench.py): it measures what
the worker's own per-request work costs (polling, leases, validation, result writes, Redis round
trips) with the model's cost taken out. It is never chosen by default and never serves real requests.
It honours the engine's interface as AsyncEngine drives it (add_request, cancel, has_work, step,
stats, abort_all) and answers each request with one token: its first label for `choices`, else the
first word of its prompt (or of its last message), finish reason `eos`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

from worker.config import STAND_IN_MODEL
from worker.engine.request import EngineError, EngineRequest, EngineResult, EngineStats, LabelScore
from worker.engine_config import EngineConfig

__all__ = ["STAND_IN_MODEL", "InstantEngine"]
CONTEXT = 1 << 20


class InstantEngine:
    """The synchronous core AsyncEngine steps, answering everything queued at each step."""

    fingerprint = "stand-in"
    dtype_name = None  # no arithmetic: results name none
    batch_invariant = None
    max_model_len = CONTEXT
    embedding_size = None  # it answers generation requests only
    loras = None  # and serves no LoRA adapters

    def __init__(self) -> None:
        self._inbox: deque[EngineRequest] = deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self.tokens_generated = 0
        self.steps = 0
        self.scheduler = SimpleNamespace(running=[])  # AsyncEngine.generated_tokens reads it
        none = SimpleNamespace(dtype="none")
        self.model_runner = SimpleNamespace(  # what the heartbeat and metrics describe
            device="cpu",
            model=none,
            kv_caches=[[none]],
            backend=SimpleNamespace(name="stand-in"),
            block_size=16,
        )

    @classmethod
    def load(cls, cfg: EngineConfig) -> InstantEngine:
        return cls()

    def add_request(self, req: EngineRequest) -> None:
        with self._lock:
            self._inbox.append(req)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def has_work(self) -> bool:
        return bool(self._inbox)

    def step(self) -> list[EngineResult]:
        with self._lock:
            reqs, self._inbox = list(self._inbox), deque()
            cancelled, self._cancelled = self._cancelled, set()
        self.steps += 1
        now = time.monotonic()
        out = []
        for req in reqs:
            total = now - (req.started_at or now)
            if req.request_id in cancelled:
                out.append(EngineResult.unstarted(req.request_id, "cancelled", total))
                continue
            out.append(_answer(req, total))
        self.tokens_generated += sum(r.completion_tokens for r in out)
        return out

    def abort_all(self, error: EngineError) -> list[EngineResult]:
        with self._lock:
            reqs, self._inbox = list(self._inbox), deque()
        return [EngineResult.unstarted(r.request_id, "error", 0.0, error) for r in reqs]

    def stats(self) -> EngineStats:
        return EngineStats(
            running=0, waiting=len(self._inbox), kv_blocks_used=0, kv_blocks_total=1,
            tokens_generated=self.tokens_generated, prompt_tokens=0, cached_prompt_tokens=0, steps=self.steps,
            prefill_steps=0, preemptions=0, prefill_s=0.0, decode_s=0.0,
        )  # fmt: skip


def _answer(req: EngineRequest, total_s: float) -> EngineResult:
    choices = req.params.choices
    if choices:
        n = len(choices)
        text = choices[0]
        scores = [LabelScore(c, -float(i), 1.0 / n) for i, c in enumerate(choices)]
    else:
        source = req.prompt if req.prompt is not None else (req.messages or [{}])[-1].get("content", "")
        text, scores = (str(source).split() or [""])[0], None
    prompt = (
        req.prompt
        if req.prompt is not None
        else " ".join(str(m.get("content", "")) for m in req.messages or [])
    )
    return EngineResult(
        request_id=req.request_id, text=text, token_ids=[0], finish_reason="eos",
        prompt_tokens=max(1, len(prompt) // 4), completion_tokens=1, cached_tokens=0, ttft_s=total_s,
        total_s=total_s, error=None, label_scores=scores, logprobs=None,
    )  # fmt: skip
