"""Runs one scheduled batch through the model: builds packed inputs, owns the KV pool, samples.

The runner never decides anything: it gets block tables from the scheduler and returns token ids.
Each phase builds its inputs in its own function (`prefill_inputs`, `decode_inputs`) into one
`StepInputs`, which the forward pass takes whatever the phase. One host sync per step (the sampled
ids' .tolist()).
"""

from __future__ import annotations

import logging
import operator
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from worker.engine.block_manager import TableRows
from worker.engine.grammar import mask_logits
from worker.engine.kv_pool import copy_kv_blocks
from worker.engine.params import GenerationParams
from worker.engine.pooling import PoolRows, pool
from worker.engine.sampler import Sampler, SamplingBatch
from worker.engine.scheduler import ScheduledBatch, Tables
from worker.engine.sequence import RowLogprobs, Sequence
from worker.engine.step_extras import batch_rows, step_extras
from worker.engine.step_io import DecodeDone, StepInputs, decode_to_device, upload
from worker.kernels.backend import Backend
from worker.models.layers import AttentionMetadata, KVCache
from worker.models.llama import LlamaFamilyModel
from worker.models.transformers_model import AnyModel

# GenerationParams' per-row sampling settings but the seed, in _sample's column order (Sequence.sampling)
_SAMPLING_FIELDS = operator.attrgetter(
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias",
)  # fmt: skip
_SAMPLING = operator.attrgetter("sampling")
_FAST = operator.attrgetter("fast")
_INFLIGHT_ROW = operator.attrgetter("inflight_row")
_SEED = operator.attrgetter("params.seed")
# a row of greedy decoding and nothing else: temperature 0, no filter, penalty or bias
_PLAIN_GREEDY = (0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, ())
_SAMPLING_ROWS_KEPT = 4096  # distinct sampling rows interned before the table starts over

if TYPE_CHECKING:
    from worker.engine.cuda_graphs import CudaGraphRunner
    from worker.engine.images import Images
    from worker.engine.lora import LoraManager

log = logging.getLogger(__name__)


SCORE_ROWS = 512  # label positions whose logits are computed at once ([rows, vocab] float32)


@dataclass
class ScoredLabels:
    """A `choices` sequence's score step: each label's log-probability (label tokens, then EOS) and, when
    its params ask for logprobs, each label's terms of that sum as rows (top alternatives where asked)."""

    logprobs: list[float]
    rows: list[list[RowLogprobs]] | None


@dataclass
class StepOutput:
    sampled: list[int]  # the batch's sequences sampled from (all but unfinished prompt chunks)
    tokens: list[int]  # one sampled token per sequence sampled from
    logprobs: list[RowLogprobs | None]  # per sequence sampled from, where its params ask for them
    label_scores: list[ScoredLabels] | None  # score steps: one per sequence
    # n > 1: per batch.forks entry, the sample's first token (from its leader's logits row) and logprobs
    fork_tokens: list[int] = field(default_factory=list)
    fork_logprobs: list[RowLogprobs | None] = field(default_factory=list)
    embeddings: dict[int, list[float]] = field(default_factory=dict)  # batch index -> an embedding input's
    # unit vector, for the inputs whose last token this step computed


class ModelRunner:
    def __init__(
        self,
        model: AnyModel,
        backend: Backend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        max_model_len: int,
        max_num_seqs: int,
        *,
        cuda_graphs: bool,
        eos_token_id: int = 0,
    ) -> None:
        """`model` already prepared for `backend` (LlamaFamilyModel.use_backend). cuda_graphs: capture decode
        steps where they can run (CUDA + Triton; the engine passes EngineConfig.cuda_graphs)."""
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.sampler = Sampler()
        self.eos_token_id = eos_token_id  # `choices` scoring: the EOS that ends every label
        s = model.spec
        # The transformers fallback's steps are not captured: Hugging Face's layers were never checked
        # under graph capture.
        native = isinstance(model, LlamaFamilyModel)
        # Nor are a mixture of experts': routing decides on the host which experts run (moe_methods).
        use_graphs = native and cuda_graphs and device.type == "cuda" and backend.name == "triton"
        use_graphs = use_graphs and getattr(s, "moe", None) is None
        # Graphs pad batches with rows that write and read one extra block, never handed to a sequence.
        shape = backend.attention.kv_cache_shape(
            num_blocks + int(use_graphs), block_size, s.num_kv_heads, s.head_dim
        )
        # Uninitialised: a CPU pool's pages become resident only as blocks fill (the kernels never read a
        # slot no sequence owns; tests/kernels fill such slots with NaN to check).
        self.kv_caches: list[KVCache] = [
            (
                torch.empty(shape, dtype=kv_dtype, device=device),
                torch.empty(shape, dtype=kv_dtype, device=device),
            )
            for _ in range(s.num_layers)
        ]
        # the block dimension of the backend's cache layout (copy_blocks)
        one, two = (
            backend.attention.kv_cache_shape(n, block_size, s.num_kv_heads, s.head_dim) for n in (1, 2)
        )
        self._block_axis = next(i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b)
        self.graphs: CudaGraphRunner | None = None
        self.loras: LoraManager | None = None  # the engine's, where it serves LoRA adapters
        self.images: Images | None = None  # the engine's, where its model takes images
        self._sampling_rows: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # sampling_row's
        self._rows_data: object = None  # the block manager's table buffer last viewed, and the view
        self._rows_view = torch.empty(0, 0, dtype=torch.int32)
        if use_graphs and isinstance(model, LlamaFamilyModel):
            from worker.engine.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(
                model, backend, self.kv_caches, block_size, num_blocks, max_num_seqs, max_model_len, device
            )

    def _extras(self, seqs: list[Sequence], counts: list[int] | None, positions: Tensor) -> Tensor:
        """Set the step's LoRA rows and image embeddings on the model (step_extras.py) for `seqs`, `counts`
        rows each (default 1); -> the model's positions ([3, T] under M-RoPE with images)."""
        if self.loras is None and self.images is None:
            return positions
        extras = step_extras(self.loras, self.images, seqs, counts, positions, self.device)
        extras.apply(self.model)
        return extras.positions(positions)

    def _tensor(self, data: list[int] | list[list[int]], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _block_table_tensor(self, tables: Tables, device: torch.device | None = None) -> Tensor:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32, device=device or self.device)  # [B, width]

    def _slots(self, block_tables: Tensor, seq_index: Tensor, positions: Tensor) -> Tensor:
        # block_tables: [B, W]; seq_index, positions: [T] -> slot of each token: [T] int64
        blocks = block_tables[seq_index, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def _packed(
        self, tables: Tables, lens: list[int], starts: list[int], context: list[int]
    ) -> tuple[Tensor, AttentionMetadata, Tensor]:
        """Rows of `lens` new tokens each, the first at position `starts`, over `context` cached tokens
        (theirs included). -> positions [T], prefill metadata, cu_seqlens [rows + 1] int64."""
        block_tables = self._block_table_tensor(tables)
        lens_t = self._tensor(lens)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=self.device)
        cu[1:] = lens_t.cumsum(0)
        # output_size: without it repeat_interleave reads lens_t back to size its output (a GPU sync).
        seq_index = torch.repeat_interleave(
            torch.arange(len(lens), device=self.device), lens_t, output_size=sum(lens)
        )
        positions = torch.arange(sum(lens), device=self.device) - cu[:-1][seq_index]
        positions += self._tensor(starts)[seq_index]
        meta = AttentionMetadata(
            phase="prefill",
            slot_mapping=self._slots(block_tables, seq_index, positions),
            block_tables=block_tables,
            context_lens=self._tensor(context, torch.int32),
            cu_seqlens_q=cu.to(torch.int32),
        )
        return positions, meta, cu

    def prefill_inputs(self, seqs: list[Sequence], tables: Tables, lens: list[int]) -> StepInputs:
        """Each sequence's next prompt chunk, of `lens` tokens (ScheduledBatch.chunk_lens), packed without
        padding. The prompt is prefill_ids: after a preemption, the output so far too."""
        ids = [s.prefill_ids for s in seqs]
        starts = [s.num_computed for s in seqs]
        input_ids = self._tensor([t for x, a, n in zip(ids, starts, lens, strict=True) for t in x[a : a + n]])
        ends = [a + n for a, n in zip(starts, lens, strict=True)]
        positions, meta, cu = self._packed(tables, lens, starts, ends)
        done = [i for i, (x, end) in enumerate(zip(ids, ends, strict=True)) if end == len(x)]
        return StepInputs(input_ids, positions, meta, cu[1:][done] - 1, done)

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Decode rows first, then prompt chunks, in one pass (a "mixed" step) where both are present."""
        nd = batch.num_decode if batch.phase != "prefill" else 0
        rows, table_rows = batch.rows, batch.table_rows
        if batch.phase == "decode":
            return self.decode_inputs(batch.seqs, batch.block_tables, rows, table_rows)
        pre = self.prefill_inputs(batch.seqs[nd:], batch.block_tables[nd:], batch.chunk_lens())
        if nd == 0:
            return pre
        dec = self.decode_inputs(
            batch.seqs[:nd], batch.block_tables[:nd], None if rows is None else rows[:nd], table_rows
        )
        meta = AttentionMetadata(
            phase="mixed",
            slot_mapping=torch.cat([dec.meta.slot_mapping, pre.meta.slot_mapping]),
            block_tables=pre.meta.block_tables,
            context_lens=pre.meta.context_lens,
            cu_seqlens_q=pre.meta.cu_seqlens_q,
            decode=dec.meta,
        )
        return StepInputs(
            torch.cat([dec.input_ids, pre.input_ids]),
            torch.cat([dec.positions, pre.positions]),
            meta,
            torch.cat([dec.logits_index, pre.logits_index + nd]),
            [*range(nd), *(nd + i for i in pre.sampled)],
        )

    def decode_inputs(
        self,
        seqs: list[Sequence],
        tables: Tables,
        rows: list[int] | None = None,
        table_rows: TableRows | None = None,
        on_host: bool = False,
    ) -> StepInputs:
        """Every sequence's last sampled token, at the position after its cached context. The block tables
        come from the block manager's buffer where the batch names its rows (the scheduler's batches do),
        else from `tables`, padded. on_host: left on the CPU (step_io.decode_to_device moves them later)."""
        n, bs = len(seqs), self.block_size
        # (Sequence.num_tokens and last_token, inline: these two run over every decoding sequence each step.
        # A token in flight, Engine's overlap, counts; its id is not known here: launch_decode's step takes it
        # from the step in flight.)
        packed = array("q", [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs])
        context = [len(s.prompt_ids) + len(s.output_ids) + s.inflight for s in seqs]
        packed.extend(context)
        from_rows = rows is not None and table_rows is not None
        if from_rows:
            packed.extend(rows)  # type: ignore[arg-type]
        ints = torch.frombuffer(packed, dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
        if from_rows:
            assert table_rows is not None
            if table_rows.data is not self._rows_data:  # a new buffer (it grew): view it
                self._rows_data = table_rows.data
                self._rows_view = torch.frombuffer(table_rows.data, dtype=torch.int32).view(
                    -1, table_rows.width
                )
            block_tables = self._rows_view[:, : -(-max(context) // bs)].index_select(0, ints[2 * n :])
        else:
            block_tables = self._block_table_tensor(tables, torch.device("cpu"))
        # (few torch calls: each costs microseconds whatever the batch, most of a small step's fixed cost)
        positions = ints[n : 2 * n] - 1
        slots = (positions % bs).add_(
            block_tables.gather(1, (positions // bs).unsqueeze_(1)).squeeze_(1), alpha=bs
        )
        context_lens = ints[n : 2 * n].to(torch.int32)
        meta = AttentionMetadata(
            phase="decode", slot_mapping=slots, block_tables=block_tables, context_lens=context_lens
        )
        step = StepInputs(ints[:n], positions, meta, torch.arange(n), list(range(n)), every_row=True)
        return step if on_host else decode_to_device(step, self.device)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[Tensor, list[int]]:
        """Run the forward pass, writing the batch's K/V into the pool. -> logits [S, vocab] float32 of
        the sequences sampled from, and which of the batch's sequences they are."""
        step = self.step_inputs(batch)
        g = self.graphs
        if (
            batch.phase == "decode"
            and g is not None
            and g.can_run(len(batch.seqs), step.meta.block_tables.shape[1])
        ):
            return g.run(step), step.sampled
        positions = self._extras(batch.seqs, batch_rows(batch), step.positions)
        hidden = self.model(step.input_ids, positions, step.meta, self.kv_caches, self.backend)
        rows = hidden if step.every_row else hidden[step.logits_index]  # hidden: [T, hidden]
        return self.model.compute_logits(rows), step.sampled

    def launch_decode(
        self, batch: ScheduledBatch, previous: Future[DecodeDone] | None
    ) -> Callable[[], DecodeDone]:
        """A decode step of plain sequences (Sequence.fast) for a device thread (Engine's overlap): its inputs
        and sampling settings are built here, on the caller's thread, and the work returned runs the forward
        pass and samples. With `previous` (the step in flight, which every sequence of `batch` was in), each
        input token is that step's sampled token at the sequence's row there (Sequence.inflight_row), taken
        on the device thread once that step is done: no host sync between the two steps."""
        seqs, dev = batch.seqs, self.device
        # Its inputs reach the device on the device thread, from pinned memory without a wait (step_io).
        step = self.decode_inputs(seqs, batch.block_tables, batch.rows, batch.table_rows, on_host=True)
        g = self.graphs
        graphs = g if g is not None and g.can_run(len(seqs), step.meta.block_tables.shape[1]) else None
        sampling = self._sampling_batch(seqs)
        source = None
        if previous is not None:
            source = torch.frombuffer(array("q", map(_INFLIGHT_ROW, seqs)), dtype=torch.int64)
        threads = torch.get_num_threads()
        extras = None
        if self.loras is not None or self.images is not None:
            extras = step_extras(self.loras, self.images, seqs, None, step.positions, self.device)

        @torch.inference_mode()
        def work() -> DecodeDone:
            t0 = time.monotonic()
            on_dev = decode_to_device(step, dev)
            positions = on_dev.positions
            if extras is not None:  # set here: the step before it ran on this thread with its own
                extras.apply(self.model)
                positions = extras.positions(positions)
            if torch.get_num_threads() != threads:  # (OpenMP's thread count is each thread's own)
                torch.set_num_threads(threads)
            ids = None
            if previous is not None and source is not None:
                ids = previous.result().tokens.index_select(0, upload(source, dev))
            if graphs is not None:
                logits = graphs.run(on_dev, ids)
            else:
                ids = on_dev.input_ids if ids is None else ids
                logits = self.model.compute_logits(
                    self.model(ids, positions, on_dev.meta, self.kv_caches, self.backend)
                )
            return DecodeDone.of(self.sampler(logits, sampling), time.monotonic() - t0)

        return work

    def compute_logits(self, batch: ScheduledBatch) -> Tensor:
        """forward()'s logits (tests compare them with HF's)."""
        return self.forward(batch)[0]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Prefill or decode: one sampled token per sequence (and its logprobs where asked).
        Score: every label's log-probability per `choices` sequence."""
        if batch.phase == "score":
            return StepOutput([], [], [], self.score_labels(batch.seqs, batch.block_tables))
        nd = batch.num_decode
        if any(s.pooling is not None for s in batch.seqs[nd:]):  # embedding inputs come as prompt chunks
            return self._run_pooling(batch)
        # A decode step's sampling settings come first, while its sequences are in the CPU's caches (the
        # forward pass and LM head pass through a good deal of memory).
        early = batch.phase == "decode" and not batch.forks
        prepared = (self._sampling_batch(batch.seqs), all(map(_FAST, batch.seqs))) if early else None
        logits, sampled = self.forward(batch)  # [S, vocab] float32
        return self._sample(batch, logits, sampled, prepared)

    def _run_pooling(self, batch: ScheduledBatch) -> StepOutput:
        """A step with embedding inputs among its chunks: their hidden states are pooled, never sampled
        from; the other sequences sample as in any step."""
        step = self.step_inputs(batch)
        positions = self._extras(batch.seqs, batch_rows(batch), step.positions)
        hidden = self.model(step.input_ids, positions, step.meta, self.kv_caches, self.backend)
        nd = batch.num_decode
        rows, at = [], nd  # the chunks' rows follow the decode rows, one each
        for j, n in enumerate(batch.chunks):
            seq = batch.seqs[nd + j]
            if seq.pooling is not None:
                rows.append(PoolRows(nd + j, at, n, seq.num_computed + n == len(seq.prefill_ids)))
            at += n
        embeddings = pool(hidden, batch.seqs, rows)
        keep = [j for j, i in enumerate(step.sampled) if batch.seqs[i].pooling is None]
        if not keep:
            return StepOutput([], [], [], None, embeddings=embeddings)
        logits = self.model.compute_logits(hidden[step.logits_index[self._tensor(keep)]])
        out = self._sample(batch, logits, [step.sampled[j] for j in keep])
        out.embeddings = embeddings
        return out

    def _sample(
        self,
        batch: ScheduledBatch,
        logits: Tensor,
        sampled: list[int],
        prepared: tuple[SamplingBatch, bool] | None = None,
    ) -> StepOutput:
        """One token per sequence of `sampled` (batch indices) from its row of logits [S, vocab] float32;
        `prepared`: where the caller made them (every row sampled, no forks), their settings
        (_sampling_batch) and whether every one is Sequence.fast."""
        seqs = [batch.seqs[i] for i in sampled]
        num_sampled = len(seqs)
        if batch.forks:  # each forked sample draws its first token from its leader's row, with its own seed
            row_of = {b: r for r, b in enumerate(sampled)}
            logits = torch.cat([logits, logits[self._tensor([row_of[i] for i, _ in batch.forks])]])
            seqs += [f for _, f in batch.forks]
        # Raw log-probabilities: before penalties, temperature, filtering and grammar masks (a ranked
        # sample's too: best_of ranks by them). A fast sequence (Sequence.fast) asks for neither.
        plain = prepared[1] if prepared is not None else all(map(_FAST, seqs))
        lp_rows = [] if plain else [i for i, s in enumerate(seqs) if s.params.logprobs or s.ranked]
        raw = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        masked = [] if plain else [i for i, s in enumerate(seqs) if s.constrained]
        if masked:
            # a reasoning model that has not opened its thinking may still open it instead of answering
            opening: list[tuple[int, int]] = []
            for i in masked:
                reasoning = seqs[i].reasoning
                if reasoning is not None and reasoning.opening_token is not None:
                    opening.append((i, reasoning.opening_token))
            kept = [logits[i, t].clone() for i, t in opening]
            mask_logits(logits, masked, [seqs[i].matcher for i in masked])
            for (i, t), value in zip(opening, kept, strict=True):
                logits[i, t] = value
        sampling = prepared[0] if prepared is not None else self._sampling_batch(seqs)
        tokens: list[int] = self.sampler(logits, sampling).tolist()
        logprobs: list[RowLogprobs | None] = [None] * len(seqs)
        if raw is not None:
            picked = torch.tensor([tokens[i] for i in lp_rows], device=raw.device).unsqueeze(1)
            chosen = raw.gather(1, picked).squeeze(1).tolist()
            k = max(seqs[i].params.top_logprobs for i in lp_rows)
            top_v, top_i = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
            top_vs, top_is = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(lp_rows):
                n = seqs[i].params.top_logprobs
                logprobs[i] = RowLogprobs(tokens[i], chosen[j], top_is[j][:n], top_vs[j][:n])
        ns = num_sampled
        return StepOutput(sampled, tokens[:ns], logprobs[:ns], None, tokens[ns:], logprobs[ns:])

    def sampling_row(self, params: GenerationParams) -> tuple[Any, ...]:
        """The params' sampling settings but the seed (Sequence.sampling), one shared tuple per distinct
        value: a step whose rows share theirs (a batch job's) builds its columns without reading each row."""
        row = _SAMPLING_FIELDS(params)
        if len(self._sampling_rows) >= _SAMPLING_ROWS_KEPT:
            self._sampling_rows.clear()
        try:
            return self._sampling_rows.setdefault(row, row)
        except TypeError:  # a logit_bias given as a list: its own row
            return row

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampler's columns of `seqs`; the token lists, seeds and RNG counters only where a row needs them."""
        n = len(seqs)
        rows = list(map(_SAMPLING, seqs))
        if None in rows:  # a sequence the engine did not admit (a test's)
            rows = [
                r if r is not None else self.sampling_row(s.params) for r, s in zip(rows, seqs, strict=True)
            ]
        uniform = n > 0 and rows.count(rows[0]) == n  # one row for all (shared tuples: compared by identity)
        if uniform:
            temps, top_ks, top_ps, min_ps, reps, presence, frequency, biases = ([v] * n for v in rows[0])
        else:
            temps, top_ks, top_ps, min_ps, reps, presence, frequency, biases = (
                map(list, zip(*rows, strict=True)) if n else ([] for _ in range(8))
            )
        sampled = temps.count(0.0) != n  # some row samples: its seed and counter pick its uniform
        return SamplingBatch(
            temperatures=temps,
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            repetition_penalties=reps,
            seen_token_ids=(
                [[]] * n
                if reps.count(1.0) == n
                else [
                    s.prompt_ids + s.output_ids if r != 1.0 else [] for s, r in zip(seqs, reps, strict=True)
                ]
            ),
            seeds=list(map(_SEED, seqs)) if sampled else [0] * n,
            steps=[len(s.output_ids) + s.inflight for s in seqs] if sampled else [0] * n,
            presence_penalties=presence,
            frequency_penalties=frequency,
            output_token_ids=(
                [[]] * n
                if presence.count(0.0) == n and frequency.count(0.0) == n
                else [
                    s.output_ids if p or f else [] for s, p, f in zip(seqs, presence, frequency, strict=True)
                ]
            ),
            logit_biases=biases,
            plain_greedy=uniform and rows[0] == _PLAIN_GREEDY,
        )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K/V in every layer: a forked sample's own copy of its
        leader's partial last prompt block."""
        if not copies:
            return
        copy_kv_blocks(self.kv_caches, self._block_axis, copies)
        shared = getattr(self.model, "copy_blocks", None)  # tensor parallelism: every rank's pool
        if shared is not None:
            shared(self._block_axis, copies)

    @torch.inference_mode()
    def score_labels(self, seqs: list[Sequence], tables: Tables) -> list[ScoredLabels]:
        """Each label's log-probability after its sequence's prompt (and thinking): the sum over its tokens, then the
        first EOS, of log p(token | prompt, label tokens before it), in one packed forward pass.

        A label row reads the prompt's full blocks in place and recomputes the prompt's tail after them
        (its last token's logits score the label's first token) into the sequence's scratch blocks, then
        teacher-forces the label. -> per sequence, its labels' scores, and where its params ask for
        logprobs each label's target rows (the terms of its sum, with their top alternatives).
        """
        bs = self.block_size
        eos = self.eos_token_id
        ids: list[int] = []
        rows: list[list[int]] = []  # each label row's block table
        starts: list[int] = []
        context: list[int] = []
        lens: list[int] = []
        wanted: list[int] = []  # packed-token index of every position whose logits score a target
        targets: list[int] = []
        sizes: list[int] = []  # targets per label
        top_rows: list[int] = []  # targets whose sequence asks for top alternatives (ascending)
        per_seq: list[int] = []  # rows of each sequence (its LoRA adapter's)
        for seq, table in zip(seqs, tables, strict=True):
            assert seq.labels is not None
            at = len(ids)
            # the context: the prompt, and a reasoning model's thinking before the answer
            context_ids = seq.prefill_ids
            full = (len(context_ids) - 1) // bs
            tail = context_ids[full * bs :]
            scratch = -(-len(context_ids) // bs)  # the scratch blocks follow the context's own
            for label in seq.labels:
                new = tail + label
                k = -(-len(new) // bs)
                first = len(ids)
                ids += new
                starts.append(full * bs)
                rows.append(table[:full] + table[scratch : scratch + k])
                scratch += k
                context.append(full * bs + len(new))
                lens.append(len(new))
                wanted += range(first + len(tail) - 1, first + len(new))
                if seq.params.logprobs and seq.params.top_logprobs:
                    top_rows += range(len(targets), len(targets) + len(label) + 1)
                targets += [*label, eos]
                sizes.append(len(label) + 1)
            per_seq.append(len(ids) - at)
        positions, meta, _ = self._packed(rows, lens, starts, context)
        positions = self._extras(seqs, per_seq, positions)
        hidden = self.model(self._tensor(ids), positions, meta, self.kv_caches, self.backend)  # [T, hidden]
        picked = hidden[self._tensor(wanted)]
        target_t = self._tensor(targets)
        scores = torch.empty(len(targets), dtype=torch.float32, device=self.device)
        top_k = max((s.params.top_logprobs for s in seqs if s.params.logprobs), default=0)
        top_v = torch.empty(len(top_rows), top_k, dtype=torch.float32, device=self.device)
        top_i = torch.empty(len(top_rows), top_k, dtype=torch.int64, device=self.device)
        for a in range(0, len(targets), SCORE_ROWS):  # [rows, vocab] logits a chunk at a time
            b = min(len(targets), a + SCORE_ROWS)
            lp = torch.log_softmax(self.model.compute_logits(picked[a:b]), dim=-1)
            scores[a:b] = lp.gather(1, target_t[a:b].unsqueeze(1)).squeeze(1)
            lo, hi = bisect_left(top_rows, a), bisect_left(top_rows, b)
            if hi > lo:  # only the rows that ask: a top-k over the vocabulary is not free
                top_v[lo:hi], top_i[lo:hi] = lp[self._tensor(top_rows[lo:hi]) - a].topk(top_k, dim=-1)
        sums = [float(t.sum()) for t in torch.split(scores, sizes)]
        # Each label's terms come from its own targets: labels sharing a prefix ("pos", "positive") share
        # tokens, never these numbers.
        values = scores.tolist() if any(s.params.logprobs for s in seqs) else []
        tops = iter(zip(top_i.tolist(), top_v.tolist(), strict=True))  # in target order, as top_rows
        bounds = list(accumulate(sizes, initial=0))  # label L's targets: bounds[L] to bounds[L + 1]
        out: list[ScoredLabels] = []
        at = 0  # the sequence's first label
        for seq in seqs:
            assert seq.labels is not None
            labels = range(at, at + len(seq.labels))
            per_label: list[list[RowLogprobs]] | None = None
            if seq.params.logprobs:
                n = seq.params.top_logprobs
                per_label = []
                for lab in labels:
                    label_rows = []
                    for t in range(bounds[lab], bounds[lab + 1]):
                        top_ids, top_lps = next(tops) if n else ([], [])
                        label_rows.append(RowLogprobs(targets[t], values[t], top_ids[:n], top_lps[:n]))
                    per_label.append(label_rows)
            out.append(ScoredLabels(sums[labels.start : labels.stop], per_label))
            at = labels.stop
        return out
