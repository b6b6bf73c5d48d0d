"""CUDA graphs for the decode step: embedding -> layers -> norm -> lm_head, captured once per batch size.

Decode at serving batch sizes is launch-bound: every layer is a dozen small kernels, and the host cannot
launch them as fast as the GPU runs them. A replayed graph launches the whole step at once.

Inputs live in static buffers allocated once; a batch is padded up to the next captured size, and the
padded rows (context 1, one token) read and write only a dummy KV block that the block manager never
hands out, so they never touch a real sequence's cache. The block-table buffer has a fixed width
(max_model_len / block_size), which fixes the Triton decode launcher's split-K choice per captured size.
A step's inputs come as the eager path's device tensors (ModelRunner.decode_inputs) and are copied in on
the device; under async scheduling the input ids are the step in flight's sampled ids, still on the
device, so a graphed step can be launched behind the one running without a host sync.

Only for CUDA with the Triton backend: its launchers size their grids from shapes alone (no .item(), no
.tolist(), scratch buffers from the caching allocator), so they are capture-safe. The torch backend
reads context_lens on the host and cannot be captured.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from worker.kernels.backend import Backend
from worker.models.layers import AttentionMetadata
from worker.models.llama import KVCache, LlamaFamilyModel

if TYPE_CHECKING:
    from worker.engine.step_io import StepInputs

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16, and max_num_seqs itself (padding stays < 16 rows)."""
    small = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    return sorted({*small, *range(16, max_num_seqs, 16), max_num_seqs})


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes sorted), or None when n is larger than every size."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner:
    """Captured decode graphs over static input buffers; `run` copies a step in, pads, replays, slices logits."""

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
        capture: bool = True,
    ) -> None:
        """capture=False: no graphs, each replay the same forward run eagerly (EagerReplay)."""
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
        self._real = 0  # rows 0.._real hold a step's inputs; the rest are padding rows
        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        self.logits: dict[int, Tensor] = {}  # size -> [size, vocab] float32, written by each replay
        if capture:
            self._capture()
        else:
            self.graphs = {size: EagerReplay(self, size) for size in self.sizes}

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

    def can_run(self, num_seqs: int, width: int) -> bool:
        """Whether a decode step of `num_seqs` rows whose block tables are `width` wide has a graph."""
        return num_seqs <= self.sizes[-1] and width <= self.width

    def run(self, step: StepInputs, input_ids: Tensor | None = None) -> Tensor:
        """A decode step's inputs (ModelRunner.decode_inputs', on the device) copied into the static buffers
        of the smallest captured size that holds them, and that graph replayed. input_ids: the step's input
        tokens where they are not step.input_ids (async scheduling: the step in flight's sampled ids).
        -> logits [rows, vocab] float32, a view into the graph's output: read it before the next run."""
        meta = step.meta
        n, width = meta.block_tables.shape
        size = bucket(n, self.sizes)
        assert size is not None and width <= self.width, "check can_run first"
        self.input_ids[:n].copy_(step.input_ids if input_ids is None else input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        # Columns past `width` keep stale block ids; the kernel masks every position >= context_len.
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if self._real > n:  # rows a larger batch left real: padding again, since a graph may read them
            self._pad(n, self._real)
        self._real = n
        self.graphs[size].replay()
        return self.logits[size][:n]

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi as padding: token 0 at position 0, context 1, writing and reading only the dummy block."""
        self.input_ids[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.slot_mapping[lo:hi] = self.dummy_block * self.block_size
        self.context_lens[lo:hi] = 1
        self.block_tables[lo:hi] = self.dummy_block


class EagerReplay:
    """A graph's stand-in where none is captured (CudaGraphRunner(capture=False), as on a CPU): replay() runs
    the forward a graph would hold over the same static buffers. The tests check the graph path's staging
    and padding with it, and benchmarks/host_overhead.py --graphs times the host's part of that path."""

    def __init__(self, runner: CudaGraphRunner, size: int) -> None:
        self.runner, self.size = runner, size

    def replay(self) -> None:
        self.runner.logits[self.size] = self.runner._forward(self.size)
