"""The CUDA-graph decode path without CUDA: a CudaGraphRunner whose replays run the forward eagerly over its
static buffers (capture=False), for the tests of its staging and padding and for benchmarks/host_overhead.py
--graphs, which times the host's part of that path."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from worker.engine.cuda_graphs import CudaGraphRunner
from worker.engine.engine import Engine
from worker.engine.model_runner import ModelRunner


class CountedGraphs(CudaGraphRunner):
    """CudaGraphRunner(capture=False) counting its replays."""

    replays = 0

    def _forward(self, size: int) -> Tensor:
        self.replays += 1
        return super()._forward(size)


def eager_graphs(
    runner: ModelRunner, dummy: int, max_model_len: int, max_num_seqs: int, sizes: list[int] | None = None
) -> CountedGraphs:
    """A graph runner over `runner`'s pool (block `dummy` its padding rows'), not installed; `sizes`: the
    batch sizes it pads to, if not capture_sizes(max_num_seqs)."""
    graphs = CountedGraphs(runner.model, runner.backend, runner.kv_caches, runner.block_size, dummy,  # type: ignore[arg-type]
                           max_num_seqs, max_model_len, runner.device, capture=False)  # fmt: skip
    if sizes is not None:
        graphs.sizes = sizes
    return graphs


def install_eager_graphs(engine: Engine, **kw: Any) -> CountedGraphs:
    """An engine's runner given eager graphs before any request: its pool reallocated one block larger, the
    graphs' dummy block (ModelRunner adds it only where graphs are captured)."""
    r = engine.model_runner
    shape = list(r.kv_caches[0][0].shape)
    dummy = shape[r._block_axis]
    shape[r._block_axis] = dummy + 1
    like = r.kv_caches[0][0]
    r.kv_caches = [
        (
            torch.empty(shape, dtype=like.dtype, device=like.device),
            torch.empty(shape, dtype=like.dtype, device=like.device),
        )
        for _ in r.kv_caches
    ]
    r.graphs = eager_graphs(r, dummy, engine.max_model_len, engine.cfg.max_num_seqs, **kw)
    return r.graphs
