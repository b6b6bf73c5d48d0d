"""The synchronous engine: tokenise and validate requests, schedule, run, apply stop rules.

`step()` is the whole loop body; `generate()` runs it to completion; AsyncEngine runs it on a thread.
Per-request failures become EngineResults with finish_reason "error", never exceptions.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

import torch

from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.model_runner import ModelRunner
from worker.engine.request import EngineRequest, EngineResult, EngineStats
from worker.engine.resources import (
    bound_onednn_caches,
    keep_freed_memory,
    pick_device,
    pick_dtype,
    size_kv_pool,
)
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.stop_rules import StopRules
from worker.kernels import native as native_kernel
from worker.kernels.backend import select_backend
from worker.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)


class RequestError(ValueError):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class Engine:
    def __init__(self, cfg: EngineConfig, loaded: LoadedModel, runner: ModelRunner, num_blocks: int) -> None:
        self.cfg = cfg
        self.model_name = loaded.name
        self.checkpoint_dir = loaded.checkpoint_dir  # a local HF dir (the GGUF cache for .gguf inputs)
        self.tokenizer: Any = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = min(loaded.max_model_len, cfg.max_model_len or loaded.max_model_len)
        self.runner = runner
        self.block_manager = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            policy="longest_first" if cfg.schedule_policy == "longest_first" else "fcfs",
        )
        self.stop_rules = StopRules(self.eos_token_ids, cfg.repetition_window, cfg.repetition_repeats)
        self._lock = threading.Lock()
        self._inbox: list[tuple[EngineRequest, float]] = []
        self._cancelled: set[str] = set()
        self._seqs: dict[str, Sequence] = {}
        self._steps = 0
        self._prefill_steps = 0
        self._prefill_s = 0.0
        self._decode_s = 0.0
        self._tokens_generated = 0
        self._prompt_tokens = 0

    @classmethod
    def load(cls, cfg: EngineConfig) -> Engine:
        device = pick_device(cfg.device)
        if device.type == "cpu":
            bound_onednn_caches()  # before the dtype probe's matmuls
        dtype = pick_dtype(cfg.dtype, device)
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        t0 = time.monotonic()
        loaded = load_model(cfg.model, dtype, device)
        if device.type == "cpu":
            keep_freed_memory()  # after loading: the checkpoint's copy of the weights goes back to the OS
            native_kernel.library()  # build the C decode kernel (or warn) now, not in the first decode step
        backend = select_backend(device, cfg.attention_backend)
        num_blocks = size_kv_pool(cfg, loaded.model, dtype, device)
        runner = ModelRunner(
            loaded.model,
            backend,
            num_blocks,
            cfg.block_size,
            device,
            dtype,
            cuda_graphs=cfg.cuda_graphs,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=min(loaded.max_model_len, cfg.max_model_len or loaded.max_model_len),
        )
        log.info(
            "loaded %s in %.1fs: %s %s, %s attention, %d KV blocks of %d tokens",
            cfg.model,
            time.monotonic() - t0,
            device,
            dtype,
            backend.name,
            num_blocks,
            cfg.block_size,
        )
        return cls(cfg, loaded, runner, num_blocks)

    # ---- public API -------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Thread-safe; the request is validated and tokenised at the start of the next step."""
        with self._lock:
            self._inbox.append((req, time.monotonic()))

    def cancel(self, request_id: str) -> None:
        """Thread-safe; the request finishes "cancelled" with its partial text at the next step."""
        with self._lock:
            self._cancelled.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            if self._inbox or self._cancelled:
                return True
        return self.scheduler.has_work()

    def step(self) -> list[EngineResult]:
        """One scheduler step (a packed prefill or one decode token for every running sequence)."""
        results = self._intake()
        now = time.monotonic()
        for seq in list(self.scheduler.waiting) + self.scheduler.running:
            if self.stop_rules.timed_out(seq, now):
                results.append(self._finish(seq, "timeout", now))
        batch = self.scheduler.schedule()
        if batch is None:
            return results
        t0 = time.monotonic()
        tokens = self.runner.run(batch)
        now = time.monotonic()
        self._steps += 1
        if batch.phase == "prefill":
            self._prefill_steps += 1
            self._prefill_s += now - t0
        else:
            self._decode_s += now - t0
        self._tokens_generated += len(tokens)
        for seq, token in zip(batch.seqs, tokens, strict=True):
            reason = self.stop_rules.append_token(seq, token, now)
            if reason is not None:
                results.append(self._finish(seq, reason, now))
        return results

    def generate(self, reqs: list[EngineRequest]) -> list[EngineResult]:
        """Offline: run every request to completion; results in input order."""
        for r in reqs:
            self.add_request(r)
        done: dict[str, EngineResult] = {}
        while self.has_work():
            for res in self.step():
                done[res.request_id] = res
        return [done[r.request_id] for r in reqs]

    def stats(self) -> EngineStats:
        with self._lock:
            inbox = len(self._inbox)
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + inbox,
            kv_blocks_used=self.block_manager.num_used,
            kv_blocks_total=self.block_manager.num_blocks,
            tokens_generated=self._tokens_generated,
            prompt_tokens=self._prompt_tokens,
            steps=self._steps,
            prefill_steps=self._prefill_steps,
            prefill_s=self._prefill_s,
            decode_s=self._decode_s,
        )

    def abort_all(self, error_type: str, message: str) -> list[EngineResult]:
        """Fail every request the engine holds (used after an unexpected internal error)."""
        now = time.monotonic()
        with self._lock:
            pending, self._inbox = self._inbox, []
        results = [self._error_result(r, error_type, message, now, t) for r, t in pending]
        for seq in list(self._seqs.values()):
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
            results.append(self._error_result_from_seq(seq, error_type, message, now))
        return results

    # ---- internals --------------------------------------------------------------------------------

    def _intake(self) -> list[EngineResult]:
        with self._lock:
            pending, self._inbox = self._inbox, []
            cancelled, self._cancelled = self._cancelled, set()
        results: list[EngineResult] = []
        now = time.monotonic()
        for req, received in pending:
            if req.request_id in cancelled:
                cancelled.discard(req.request_id)
                results.append(self._empty_result(req, "cancelled", now, received))
                continue
            try:
                seq = self._make_sequence(req, received)
            except RequestError as exc:
                results.append(self._error_result(req, exc.error_type, str(exc), now, received))
                continue
            self._seqs[seq.request_id] = seq
            self._prompt_tokens += seq.prompt_len
            self.scheduler.add(seq)
        for rid in cancelled:
            target = self._seqs.get(rid)
            if target is not None:
                results.append(self._finish(target, "cancelled", now))
        return results

    def _make_sequence(self, req: EngineRequest, received: float) -> Sequence:
        if req.request_id in self._seqs:
            raise RequestError("invalid_request", f"request id {req.request_id!r} is already running")
        params = req.params
        if params.max_new_tokens is None or params.temperature is None:
            raise RequestError("invalid_request", "params must be resolved (SamplingParams.resolve())")
        ids = self._tokenize(req)
        limit = self.max_model_len
        if len(ids) >= limit:
            side = params.truncate_prompt
            if side is None:
                raise RequestError(
                    "prompt_too_long",
                    f"prompt has {len(ids)} tokens; the model context is {limit} "
                    "(set truncate_prompt to 'left' or 'right' to cut it)",
                )
            keep = max(1, limit - params.max_new_tokens)  # leave room for the requested output
            ids = ids[-keep:] if side == "left" else ids[:keep]
        max_new = min(params.max_new_tokens, limit - len(ids))
        need = self.block_manager.blocks_for(len(ids) + max_new)
        if need > self.block_manager.num_blocks:
            raise RequestError(
                "kv_capacity",
                f"request needs {need} KV blocks ({len(ids)} prompt + {max_new} new tokens, "
                f"{self.block_manager.block_size} per block) but the whole pool has "
                f"{self.block_manager.num_blocks} blocks",
            )
        return Sequence(
            request_id=req.request_id,
            params=params,
            prompt_ids=ids,
            max_new_tokens=max_new,
            started_at=req.started_at if req.started_at is not None else received,
            seed=params.seed if params.seed is not None else random.getrandbits(63),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
        )

    def _tokenize(self, req: EngineRequest) -> list[int]:
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError(
                "invalid_request", "exactly one of prompt, messages, prompt_token_ids is required"
            )
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            vocab = self.runner.model.spec.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError("invalid_request", f"prompt_token_ids must lie in [0, {vocab})")
        elif req.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("invalid_request", f"model {self.model_name!r} has no chat template")
            try:
                text = self.tokenizer.apply_chat_template(
                    req.messages, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # a template error is the request's fault, not the engine's
                raise RequestError("invalid_request", f"chat template failed: {exc}") from exc
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = self.tokenizer(req.prompt).input_ids
        if not ids:
            raise RequestError("invalid_request", "the prompt is empty after tokenisation")
        return list(ids)

    def _finish(self, seq: Sequence, reason: Any, now: float) -> EngineResult:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        return seq.to_result(now)

    @staticmethod
    def _empty_result(req: EngineRequest, reason: Any, now: float, received: float) -> EngineResult:
        start = req.started_at if req.started_at is not None else received
        return EngineResult(req.request_id, "", [], reason, 0, 0, None, now - start)

    def _error_result(
        self, req: EngineRequest, error_type: str, message: str, now: float, received: float
    ) -> EngineResult:
        res = self._empty_result(req, "error", now, received)
        res.error_type, res.error_message = error_type, message
        return res

    @staticmethod
    def _error_result_from_seq(seq: Sequence, error_type: str, message: str, now: float) -> EngineResult:
        total = now - seq.started_at
        return EngineResult(
            seq.request_id,
            "",
            [],
            "error",
            seq.prompt_len,
            len(seq.output_ids),
            None,
            total,
            error_type,
            message,
        )
