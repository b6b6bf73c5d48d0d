"""The synchronous engine: take requests, schedule, run the model, apply stop rules, return results.

`step()` is the whole loop body; `generate()` runs it to completion; AsyncEngine runs it on a thread.
Per-request failures become EngineResults with finish_reason "error", never exceptions.
The engine is a library: it takes EngineRequests (worker/engine/request.py) and knows nothing of
Redis, arq or the JSONL contract.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch

from worker.engine.assembly import (
    batch_invariant_here,
    build_model,
    engine_fingerprint_of,
    kv_cache_dtype,
    log_windows,
)
from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import IncrementalDetokenizer, detokenizer_plan
from worker.engine.embedding import EmbeddingRequests
from worker.engine.grammar import Grammars
from worker.engine.images import Images
from worker.engine.kv_pool import size_kv_pool
from worker.engine.kv_window import SlidingWindow
from worker.engine.lora import adapters, lora_manager
from worker.engine.model_runner import ModelRunner, ScoredLabels, StepOutput
from worker.engine.outputs import TokenTexts, label_scores, pick_label, sequence_result
from worker.engine.overlap import InFlight, may_overlap
from worker.engine.pooling import model_pooling
from worker.engine.prompts import PromptBuilder
from worker.engine.reasoning import ReasoningMarkers
from worker.engine.request import (
    EngineCounters,
    EngineError,
    EngineRequest,
    EngineResult,
    EngineStats,
    FinishReason,
    LabelScore,
    RequestError,
)
from worker.engine.samples import SampleGroup, combine, plan_samples, sample_seed
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import RowLogprobs, Sequence
from worker.engine.step_extras import serve_extras
from worker.engine.stop_rules import StopRules
from worker.engine.tensor_parallel import ShardedModel, load_sharded
from worker.engine_config import EngineConfig
from worker.models.loader import LoadedModel
from worker.platform import Dtypes, load_platform
from worker.platform.threads import CpuShare

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        loaded: LoadedModel,
        model_runner: ModelRunner,
        num_blocks: int,
        max_model_len: int,
        batch_invariant: bool = False,
        dtypes: Dtypes | None = None,
        cpu_share: CpuShare | None = None,
    ) -> None:
        self.cfg = cfg
        kv_dtype = model_runner.kv_caches[0][0].dtype
        dtypes = dtypes or Dtypes(kv_dtype, kv_dtype)
        compute_dtype = dtypes.compute
        self.dtype_name = dtypes.name  # the dtype as asked (or auto's choice), which results name
        # whether a request's numbers are independent of what shares its step (batch_invariant_here)
        self.batch_invariant = batch_invariant
        self.model_name = loaded.name
        self.checkpoint_dir = loaded.checkpoint_dir  # a local HF dir (the GGUF cache for .gguf inputs)
        self.tokenizer: Any = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = max_model_len
        self.model_runner = model_runner
        # The prefix cache's chain hashes are salted with what else decides K/V: model, weights, dtype.
        salt = f"{loaded.name}\0{loaded.checkpoint_dir}\0{kv_dtype}".encode()
        windows = loaded.model.layer_windows
        window = SlidingWindow.of_layers(windows, cfg.max_num_batched_tokens)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache, salt, window)
        # Layers with a window beside full-attention ones: the one block table every layer shares keeps
        # a block while a full-attention layer reads it, so nothing is released; the stats count the blocks
        # the windowed layers no longer read (what per-layer tables would free in them).
        windowed = [w for w in windows if w is not None]
        self.idle_window = max(windowed) if windowed and window is None else None
        log_windows(windows, window, self.block_manager)
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            policy=cfg.schedule_policy,
            admission=cfg.admission,
        )
        vocab = loaded.model.spec.vocab_size
        self.grammars = Grammars(self.tokenizer, vocab, self.eos_token_ids)
        self.token_texts = TokenTexts(self.grammars.token_bytes)
        model_type = getattr(loaded.hf_config, "model_type", None)
        self.reasoning = ReasoningMarkers.detect(self.tokenizer, model_type, cfg.reasoning_parser)
        if self.reasoning is not None:
            log.info(
                "reasoning parser: %s (thinking apart from the answer in chat requests)", self.reasoning.kind
            )
        self.prompts = PromptBuilder(
            self.tokenizer, loaded.name, vocab, max_model_len, self.block_manager, self.grammars.matcher,
            hidden_size=loaded.model.spec.hidden_size, reasoning=self.reasoning,
        )  # fmt: skip
        self.pooling = model_pooling(loaded.checkpoint_dir, cfg.embedding_pooling)
        self.embedding_only = loaded.embedding_only  # no LM head: generation is refused
        self.embedding_size = None if self.pooling.refused else self.prompts.hidden_size
        if self.pooling.refused:
            log.warning("embedding requests will be refused: %s", self.pooling.refused)
        self.stop_rules = StopRules(self.eos_token_ids, cfg.repetition_window, cfg.repetition_repeats)
        log.info("detokenizer: %s", detokenizer_plan(self.tokenizer).describe())  # (its table built now)
        self.fingerprint = engine_fingerprint_of(
            loaded, model_runner, cfg, self.eos_token_ids, max_model_len, compute_dtype, batch_invariant,
            self.reasoning,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._inbox: list[tuple[EngineRequest, float]] = []
        self._cancelled: set[str] = set()
        self._seqs: dict[str, Sequence] = {}
        self._next_deadline = math.inf  # the earliest Sequence.deadline of those held, or before it
        self._inflight = InFlight(model_runner)  # async scheduling's decode steps on the device thread
        self._finished = 0  # sequences finished since load
        self._groups: dict[str, SampleGroup] = {}  # n > 1: by request id, until every sample has ended
        self.embeddings = EmbeddingRequests(self.scheduler, self._seqs)  # their inputs are in _seqs too
        self.counters = EngineCounters()
        self.cpu_share = cpu_share  # the platform's co-tenant watch: the thread count follows free cores
        self.loras = lora_manager(cfg, loaded, model_runner.backend)  # None: no LoRA adapters served
        self.images = self.prompts.images = None if loaded.vision is None else Images(loaded.vision)
        self.takes_images = serve_extras(model_runner, self.scheduler, self.loras, self.images)

    @classmethod
    def load(cls, cfg: EngineConfig) -> Engine:
        """The engine composed from its parts: the platform (the machine's settings and the dtypes), the
        model, the backend (every kernel choice), the KV pool and the model runner."""
        platform = load_platform(cfg.device)
        platform.prepare(cfg)  # before any matmul: the dtype probes' included
        dtypes = platform.dtypes(cfg)
        device = platform.device
        t0 = time.monotonic()
        if cfg.tensor_parallel_size > 1:  # rank 0's share, every call of it sent to every rank
            loaded, dtypes, backend = load_sharded(cfg, platform, dtypes)
        else:
            loaded, dtypes, backend = build_model(cfg, platform, dtypes)
        kv_dtype = kv_cache_dtype(cfg, loaded, backend, dtypes, device)
        num_blocks = size_kv_pool(cfg, loaded.model, kv_dtype, device)
        max_model_len = cfg.context_len(loaded.max_model_len)
        runner = ModelRunner(
            loaded.model,
            backend,
            num_blocks,
            cfg.block_size,
            device,
            kv_dtype,
            max_model_len=max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            cuda_graphs=cfg.cuda_graphs,
            eos_token_id=loaded.eos_token_ids[0] if loaded.eos_token_ids else 0,
        )
        if isinstance(loaded.model, ShardedModel):
            loaded.model.attach_pool(runner.kv_caches)
        reset = getattr(loaded.model, "reset_expert_tokens", None)
        if reset is not None:  # the scratch passes above (pool sizing, calibration) routed tokens too
            reset()
        invariant = cfg.batch_invariant and batch_invariant_here(backend, loaded)
        log.info(
            "loaded %s in %.1fs: %s %s, %s%s, %d KV blocks of %d tokens (%s)",
            cfg.model,
            time.monotonic() - t0,
            platform.describe(),
            dtypes.compute,
            backend.summary,
            ", batch-invariant" if invariant else "",
            num_blocks,
            cfg.block_size,
            kv_dtype,
        )
        return cls(cfg, loaded, runner, num_blocks, max_model_len, invariant, dtypes, platform.cpu_share(cfg))

    # ---- public API -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what outlives a step: the ranks of a tensor-parallel group."""
        model = self.model_runner.model
        if isinstance(model, ShardedModel):
            model.close()

    def failure(self) -> str | None:
        """Why the engine cannot go on (a rank of its tensor-parallel group ended), else None."""
        model = self.model_runner.model
        return model.failure if isinstance(model, ShardedModel) else None

    def add_request(self, req: EngineRequest) -> None:
        """Thread-safe; the request is validated and tokenised at the start of the next step."""
        if req.images and self.images is not None:  # decoded on CPU threads while it waits
            self.images.start(req)
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
        return bool(self._inflight) or self.scheduler.has_work()

    def step(self) -> list[EngineResult]:
        """One scheduler step: a decode token for every prefilled sequence and prompt chunks in one forward
        pass, or a score step for `choices` requests.

        With async_scheduling, a decode step of plain sequences is launched on the device thread and taken a
        step later: while it runs, the next one is scheduled and launched behind it (its input tokens are
        this one's, taken on the device), and then this one's tokens go through the stop rules. A sequence
        that ends there has its token of the step behind discarded. Anything else (a prompt to admit, a
        request that is not plain) waits for the steps in flight to be taken, and runs serially. So does a
        cancel or a timeout: the request ends with every token of the steps done, as it would serially."""
        results: list[EngineResult] = []
        if self._inflight:
            with self._lock:
                cancels = bool(self._cancelled)
            if cancels or time.monotonic() > self._next_deadline:
                results += self._take_all_launched()
        results += self._intake()
        now = time.monotonic()
        results += self._expire(now)
        if self._inflight:
            ahead = self.scheduler.schedule_decode() if self._can_overlap() else None
            if ahead is not None:
                self._launch(ahead)
                return results + self._take_launched()
            results += self._take_all_launched()  # serial from here
        batch = self.scheduler.schedule()
        if batch is None:
            return results
        if self.cpu_share is not None and (threads := self.cpu_share.poll()) is not None:
            log.info("other processes' use of the worker's %d cores leaves room for %d CPU threads",
                     len(self.cpu_share.cpus), threads)  # fmt: skip
            torch.set_num_threads(threads)  # on the stepping thread, whose OpenMP setting counts
        if batch.phase == "decode" and not batch.forks and self._can_overlap():
            self._launch(batch)
            return results
        t0 = time.monotonic()
        out = self.model_runner.run(batch)
        now = time.monotonic()
        self._account(batch, now - t0)
        if out.label_scores is not None:
            for seq, scored in zip(batch.seqs, out.label_scores, strict=True):
                results.append(self._finish_choices(seq, scored, now))
            return results
        for seq in self.scheduler.computed(batch):
            if not seq.preemptions:  # a resumed one counted its prompt already
                self.counters.prompt_tokens += seq.prompt_len
                self.counters.cached_prompt_tokens += seq.cached_prompt_tokens
        self.model_runner.copy_blocks(self.scheduler.fork(batch))  # before any forked sample's next step
        return results + self._take_outputs(batch, out, now)

    # ---- overlap (async scheduling) ---------------------------------------------------------------

    def _can_overlap(self) -> bool:
        """Whether the next step may be launched before the one in flight is taken (overlap.may_overlap),
        where async_scheduling is on."""
        return self.cfg.async_scheduling and may_overlap(self.scheduler)

    def _launch(self, batch: ScheduledBatch) -> None:
        self.counters.overlapped_steps += self._inflight.launch(batch, self._finished)

    def _take_launched(self) -> list[EngineResult]:
        """Take the oldest launched step's tokens: its sequences' K/V is computed, its tokens go through the
        stop rules. A sequence that ended since it was launched (a stop rule a step before, a timeout, a
        cancel) has its token discarded; one preempted since takes it (it is its next token either way)."""
        batch, tokens, seconds, finished = self._inflight.take()
        now = time.monotonic()
        self._account(batch, seconds)
        if finished != self._finished:  # some sequence ended since: keep the others
            keep = [i for i, s in enumerate(batch.seqs) if s.status != "finished"]
            seqs = [batch.seqs[i] for i in keep]
            tokens = [tokens[i] for i in keep]
        else:
            seqs = batch.seqs
        running = [s for s in seqs if s.status == "running"] if self.block_manager.prefix_caching else []
        self.scheduler.computed(ScheduledBatch("decode", running, [], num_decode=len(running)))
        n = len(seqs)
        out = StepOutput(list(range(n)), tokens, [None] * n, None)
        return self._take_outputs(ScheduledBatch("decode", seqs, [], num_decode=n), out, now)

    def _take_all_launched(self) -> list[EngineResult]:
        results = []
        while self._inflight:
            results += self._take_launched()
        return results

    def _expire(self, now: float) -> list[EngineResult]:
        """End the sequences past their timeout (an embedding request's inputs end together: the first to
        time out ends the rest). Before the earliest deadline of the sequences held, no sequence is looked at."""
        if now <= self._next_deadline:
            return []
        results = []
        for seq in list(self.scheduler.waiting) + self.scheduler.running:
            expired = seq.status != "finished" and self.stop_rules.timed_out(seq, now)
            if expired and (res := self._finish(seq, "timeout", now)) is not None:
                results.append(res)
        self._next_deadline = min((s.deadline for s in self._seqs.values()), default=math.inf)
        return results

    def _take_outputs(self, batch: ScheduledBatch, out: StepOutput, now: float) -> list[EngineResult]:
        """A step's pooled vectors and sampled tokens (forked samples' first ones too) into their sequences."""
        results = []
        for i, vector in out.embeddings.items():
            if (res := self.embeddings.pooled(batch.seqs[i], vector, now)) is not None:
                results.append(res)
        # the decode rows lead the batch and its sampled rows: most of their tokens take the fast path
        nd = batch.num_decode if batch.phase != "prefill" else 0
        seqs, tokens = batch.seqs[:nd], out.tokens[:nd]
        taken = 0
        for i, reason in self.stop_rules.append_fast(seqs, tokens, now):
            if reason is None:  # the full rules, and whatever else the token needs
                res = self._take_token(seqs[i], tokens[i], out.logprobs[i], now)
                taken -= 1
            else:
                res = self._finish(seqs[i], reason, now)
            if res is not None:
                results.append(res)
        self.counters.tokens_generated += nd + taken
        rest = [
            (batch.seqs[i], t, lp)
            for i, t, lp in zip(out.sampled[nd:], out.tokens[nd:], out.logprobs[nd:], strict=True)
        ]
        forked = zip((f for _, f in batch.forks), out.fork_tokens, out.fork_logprobs, strict=True)
        for seq, token, logprobs in [*rest, *forked]:
            res = self._take_token(seq, token, logprobs, now)
            if res is not None:
                results.append(res)
        return results

    def _account(self, batch: ScheduledBatch, seconds: float) -> None:
        c = self.counters
        c.steps += 1
        if batch.phase == "decode":
            c.decode_s += seconds
        elif batch.phase == "score":
            c.score_steps += 1
            c.score_s += seconds
        else:  # a step with prompt chunks (decode rows beside them or not)
            c.prefill_steps += 1
            c.prefill_s += seconds
            c.prefill_tokens += sum(batch.chunks)

    def _take_token(
        self, seq: Sequence, token: int, logprobs: RowLogprobs | None, now: float
    ) -> EngineResult | None:
        """Append a sampled token; -> the sequence's result where a stop rule ends it."""
        if seq.labels is not None:
            return None  # prefilled: its labels are scored in a step of their own
        rs = seq.reasoning
        if rs is not None:
            forced = bool(rs.forced)
            token = rs.next_token(token)  # a thinking budget's close replaces what was sampled
            if forced:
                logprobs = None
            elif rs.opens_answer(token) and seq.pending_labels is not None:
                # The model answers without thinking: drop the token it sampled and score the labels here.
                rs.answer_now()
                self._answer_started(seq)
                return None
        self.counters.tokens_generated += 1
        was_answer = seq.in_answer
        reason = self.stop_rules.append_token(seq, token, now)
        in_answer = rs is None or len(seq.output_ids) > rs.tokens  # this token is the answer's
        if logprobs is not None:
            if seq.params.logprobs and in_answer:  # the answer's tokens only, as OpenAI's message content
                seq.token_logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs.logprob  # (rows come for a ranked sample too)
        if reason is None and seq.matcher is not None and in_answer:
            reason = self._advance_grammar(seq, token)
        if reason is None and not was_answer and seq.in_answer:
            self._answer_started(seq)
        return self._finish(seq, reason, now) if reason is not None else None

    def _answer_started(self, seq: Sequence) -> None:
        """A reasoning model's thinking just ended: a `choices` request is scored at this position."""
        if seq.pending_labels is not None:
            seq.labels, seq.pending_labels = seq.pending_labels, None

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
            preemptions=self.scheduler.preemptions,
            window_released_blocks=self.block_manager.window_released,
            window_idle_blocks=(
                0 if self.idle_window is None else self.scheduler.window_idle_blocks(self.idle_window)
            ),
            expert_tokens=dict(getattr(self.model_runner.model, "expert_tokens", dict)()),
            **vars(self.counters),
        )

    def abort_all(self, error: EngineError) -> list[EngineResult]:
        """Fail every request the engine holds (used after an unexpected internal error)."""
        self._inflight.drain()
        now = time.monotonic()
        with self._lock:
            pending, self._inbox = self._inbox, []
        results = [_unstarted(r, "error", now, received, error) for r, received in pending]
        results += [self.embeddings.end(rid, "error", now, error) for rid in list(self.embeddings.groups)]
        for seq in list(self._seqs.values()):
            if seq.request_id in self._seqs and (res := self._finish(seq, "error", now, error=error)):
                results.append(res)  # (a pending sample ends with its leader)
        return results

    # ---- internals --------------------------------------------------------------------------------

    def _intake(self) -> list[EngineResult]:
        with self._lock:
            pending, self._inbox = self._inbox, []
            if self.images is not None:  # a request joins once its images are decoded (or it is cancelled)
                pending, self._inbox = self.images.split(pending, self._cancelled)
            cancelled, self._cancelled = self._cancelled, set()
        results: list[EngineResult] = []
        now = time.monotonic()
        for req, received in pending:
            if req.request_id in cancelled:
                cancelled.discard(req.request_id)
                results.append(_unstarted(req, "cancelled", now, received))
                continue
            if (err := self._admit(req, received)) is not None:
                results.append(_unstarted(req, "error", now, received, err))
        for rid in cancelled:
            results += self._cancel(rid, now)
        return results

    def _admit(self, req: EngineRequest, received: float) -> EngineError | None:
        """A new request's sequences into the scheduler (an embedding request's inputs; a prompt and the
        samples to fork from it); -> the error that refuses it."""
        try:
            running = (self._seqs, self._groups, self.embeddings.groups)
            if any(req.request_id in ids for ids in running):
                raise RequestError("invalid_request", f"request id {req.request_id!r} is already running")
            if req.embedding is not None:
                inputs, forks = self._embedding_inputs(req, received), []
            elif self.embedding_only:
                raise RequestError(
                    "unsupported",
                    f"model {self.model_name!r} is an embedding checkpoint without an LM head: it answers "
                    "embedding requests only",
                )
            else:
                inputs = [self.prompts.sequence(req, received)]
                forks = self._fork_samples(inputs[0])
            if req.lora is not None:
                adapters(self.loras, req, (*inputs, *forks))
        except RequestError as exc:
            return EngineError(exc.error_type, str(exc))
        for s in (*inputs, *forks):
            self.stop_rules.prepare(s)
            s.sampling = self.model_runner.sampling_row(s.params)
            self._seqs[s.request_id] = s
            self._next_deadline = min(self._next_deadline, s.deadline)
        if forks:
            self._groups[inputs[0].request_id] = SampleGroup(inputs[0])
        for s in inputs:  # (forks wait on their leader's prompt, off the scheduler's queues)
            self.scheduler.add(s)
        return None

    def _cancel(self, rid: str, now: float) -> list[EngineResult]:
        if rid in self.embeddings.groups:
            return [self.embeddings.end(rid, "cancelled", now)]
        group = self._groups.get(rid)
        members = group.members if group is not None else [s for s in (self._seqs.get(rid),) if s]
        results = []
        for target in members:
            if target.request_id in self._seqs and (res := self._finish(target, "cancelled", now)):
                results.append(res)
        return results

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """n > 1: the samples to fork from `seq` once its prompt is computed (samples.plan_samples)."""
        constraint = seq.params.constraint
        fresh = self.grammars.matcher if constraint.kind != "none" else None
        return plan_samples(
            seq,
            self.scheduler,
            lambda: IncrementalDetokenizer(self.tokenizer),
            lambda: None if fresh is None else fresh(constraint),
        )

    def _embedding_inputs(self, req: EngineRequest, received: float) -> list[Sequence]:
        """An embedding request's inputs as sequences, the request held as their group."""
        pooling = self.pooling.pooling
        if pooling is None:
            raise RequestError(
                "unsupported", f"model {self.model_name!r} cannot embed: {self.pooling.refused}"
            )
        seqs = self.prompts.embedding_sequences(req, received, pooling)
        self.embeddings.add(req, seqs)
        return seqs

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> FinishReason | None:
        """Feed the grammar the token it allowed; "stop" once the grammar admits nothing more."""
        if not seq.matcher.advance(token):
            log.warning("request %s: its grammar refused token %d", seq.request_id, token)
            return "stop"
        return "stop" if seq.matcher.complete else None

    def _finish_choices(self, seq: Sequence, scored: ScoredLabels, now: float) -> EngineResult:
        """A scored `choices` request ends with its label, then EOS, as the generated tokens; where it asks
        for logprobs, they are that label's teacher-forced terms, EOS included (they sum to its score)."""
        assert seq.labels is not None
        p = seq.params
        scores = label_scores(p.choices, scored.logprobs)
        picks = [pick_label(scores, p.temperature, sample_seed(p.seed, i)) for i in range(p.samples)]
        eos = self.model_runner.eos_token_id
        samples: list[EngineResult] = []
        thought = seq.output_ids  # a reasoning model's thinking stays in front of the label (it counts)
        for i in reversed(range(p.samples)):  # sample 0 last: the sequence ends with its label
            seq.output_ids = [*thought, *seq.labels[picks[i]], eos]
            if scored.rows is not None:
                seq.token_logprobs = scored.rows[picks[i]]
            seq.text = p.choices[picks[i]]
            seq.first_token_at = now
            if i:
                samples.append(sequence_result(self.token_texts, seq, "eos", now, scores))
        res = self._finish(seq, "eos", now, scores)
        assert res is not None  # a choices request is no group
        if p.samples == 1:
            return res
        ranks = [scores[k].logprob for k in picks] if p.samples > p.n else None
        return combine(seq.request_id, [res, *reversed(samples)], p.n, ranks)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        now: float,
        scores: list[LabelScore] | None = None,
        error: EngineError | None = None,
    ) -> EngineResult | None:
        """End a sequence. -> its request's result: its own, or for a sample of an n > 1 request the
        request's once its last sample ends (a pending sample ends with its leader)."""
        if seq.embedding_of is not None:
            return self.embeddings.end(seq.embedding_of, reason, now, error)
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._finished += 1
        del self._seqs[seq.request_id]
        res = sequence_result(self.token_texts, seq, reason, now, scores, error)
        if seq.group is None:
            return res
        pending, seq.forks = seq.forks, []
        out = self._groups[seq.group].record(seq.sample_index, res)
        if out is not None:
            del self._groups[seq.group]
        for f in pending:
            out = self._finish(f, reason, now, error=error) or out
        return out


def _unstarted(
    req: EngineRequest, reason: FinishReason, now: float, received: float, error: EngineError | None = None
) -> EngineResult:
    """The result of a request that never became a sequence (cancelled before it ran, or refused)."""
    start = req.started_at if req.started_at is not None else received
    return EngineResult.unstarted(req.request_id, reason, now - start, error)
