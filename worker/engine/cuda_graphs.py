"""CUDA graphs for the decode step: embedding -> layers -> norm -> lm_head, captured once per batch size.

Decode at serving batch sizes is launch-bound: every layer is a dozen small kernels, and the host cannot
launch them as fast as the GPU runs them. A replayed graph launches the whole step at once.

Inputs live in static buffers allocated once; a batch is padded up to the next captured size, and the
padded rows (context 1, one token) read and write only a dummy KV block that the block manager never
hands out, so they never touch a real sequence's cache. The block-table buffer has a fixed width
(max_model_len / block_size), which fixes the Triton decode launcher's split-K choice per captured size.

Only for CUDA with the Triton backend: its launchers size their grids from shapes alone (no .item(), no
.tolist(), scratch buffers from the caching allocator), so they are capture-safe. The torch backend
reads context_lens on the host and cannot be captured.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.engine.scheduler import Tables
from worker.kernels.backend import Backend
from worker.models.layers import AttentionMetadata
from worker.models.llama import KVCache, LlamaFamilyModel

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16, and max_num_seqs itself (padding stays < 16 rows)."""
    small = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    return sorted({*small, *range(16, max_num_seqs, 16), max_num_seqs})


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes sorted), or None when n is larger than every size."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class PaddedDecode:
    """One decode step's inputs on the host, padded to a captured batch size."""

    input_ids: list[int]  # [size]
    positions: list[int]  # [size]
    slot_mapping: list[int]  # [size]
    context_lens: list[int]  # [size]
    block_tables: list[list[int]]  # [size, width]; width = longest real table (>= 1)

    def flat(self) -> list[int]:
        """Every field in one list, so one host->device copy carries the whole step."""
        return [
            *self.input_ids,
            *self.positions,
            *self.slot_mapping,
            *self.context_lens,
            *(b for row in self.block_tables for b in row),
        ]


def pad_decode(
    last_tokens: list[int],
    context_lens: list[int],
    tables: Tables,
    size: int,
    block_size: int,
    dummy_block: int,
) -> PaddedDecode:
    """Real rows decode their last token at position context_len - 1; rows past len(tables) up to `size`
    are padding: token 0 at position 0, context 1, writing and reading only the dummy block's first slot."""
    n = len(tables)
    assert n <= size and len(last_tokens) == n and len(context_lens) == n
    width = max([1, *(len(t) for t in tables)])
    positions = [c - 1 for c in context_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions, strict=True)]
    pad = size - n
    return PaddedDecode(
        input_ids=last_tokens + [0] * pad,
        positions=positions + [0] * pad,
        slot_mapping=slots + [dummy_block * block_size] * pad,
        context_lens=context_lens + [1] * pad,
        block_tables=[t + [dummy_block] * (width - len(t)) for t in tables] + [[dummy_block] * width] * pad,
    )


class CudaGraphRunner:
    """Captured decode graphs over static input buffers; `run` pads, copies in, replays, slices logits."""

    def __init__(
        self,
        model: LlamaFamilyModel,
        backend: Backend,
        kv_caches: list[KVCache],
        block_size: int,
        dummy_block: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size, self.dummy_block, self.device = block_size, dummy_block, device
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-max_model_len // block_size)  # blocks per sequence at most
        rows = self.sizes[-1]
        # Static inputs, initialised to padding rows so warm-up and capture touch only the dummy block.
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]
        self.slot_mapping = torch.full((rows,), dummy_block * block_size, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [rows]
        self.block_tables = torch.full((rows, self.width), dummy_block, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}  # size -> [size, vocab] float32, written by each replay
        self._capture()

    def _forward(self, size: int) -> Tensor:
        # -> logits [size, vocab] float32 from the first `size` rows of the static buffers
        meta = AttentionMetadata(
            phase="decode",
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        assert self.device.type == "cuda" and self.backend.name == "triton", "graphs need CUDA + Triton"
        t0 = time.monotonic()
        pool = None
        # Largest first: later (smaller) graphs reuse the shared pool's blocks instead of growing it.
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles the Triton kernels, lets cuBLAS pick its algorithms
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode graphs (batch %s) in %.1fs",
            len(self.sizes),
            self.sizes,
            time.monotonic() - t0,
        )

    def can_run(self, num_seqs: int, tables: Tables) -> bool:
        return num_seqs <= self.sizes[-1] and all(len(t) <= self.width for t in tables)

    def run(self, last_tokens: list[int], context_lens: list[int], tables: Tables) -> Tensor:
        """-> logits [len(tables), vocab] float32, a view into the graph's output: read it before the next run."""
        n = len(tables)
        size = bucket(n, self.sizes)
        assert size is not None, "check can_run first"
        padded = pad_decode(last_tokens, context_lens, tables, size, self.block_size, self.dummy_block)
        width = len(padded.block_tables[0])
        staged = torch.tensor(padded.flat(), dtype=torch.int64).to(self.device)  # one host->device copy
        fields = staged[: 4 * size].view(4, size)
        self.input_ids[:size].copy_(fields[0])
        self.positions[:size].copy_(fields[1])
        self.slot_mapping[:size].copy_(fields[2])
        self.context_lens[:size].copy_(fields[3])
        # Columns past `width` keep stale block ids; the kernel masks every position >= context_len.
        self.block_tables[:size, :width].copy_(staged[4 * size :].view(size, width))
        self.graphs[size].replay()
        return self.logits[size][:n]
