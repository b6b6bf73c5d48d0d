"""Runs one scheduled batch through the model: builds packed inputs, owns the KV pool, samples.

The runner never decides anything: it gets block tables from the scheduler and returns token ids.
One host sync per step (the sampled ids' .tolist()).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from worker.engine.sampler import Sampler, SamplingBatch
from worker.engine.scheduler import ScheduledBatch
from worker.kernels.backend import AttentionBackend
from worker.models.layers import AttentionMetadata
from worker.models.llama import KVCache, LlamaFamilyModel

if TYPE_CHECKING:
    from worker.engine.cuda_graphs import CudaGraphRunner

log = logging.getLogger(__name__)


def kv_bytes_per_token(model: LlamaFamilyModel, dtype: torch.dtype) -> int:
    s = model.spec
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyModel,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        cuda_graphs: bool = False,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.sampler = Sampler()
        s = model.spec
        use_graphs = cuda_graphs and device.type == "cuda" and backend.name == "triton"
        # Graphs pad batches with rows that write and read one extra block, never handed to a sequence.
        shape = backend.kv_cache_shape(num_blocks + int(use_graphs), block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(s.num_layers)
        ]
        self.graphs: CudaGraphRunner | None = None
        if use_graphs:
            from worker.engine.cuda_graphs import CudaGraphRunner

            max_len = max_model_len or int(model.rotary.cos.shape[0])
            self.graphs = CudaGraphRunner(
                model, backend, self.kv_caches, block_size, num_blocks, max_num_seqs, max_len, device
            )

    def _tensor(self, data: list[int] | list[list[int]], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _block_table_tensor(self, tables: list[list[int]]) -> Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)  # [B, width]

    def _slots(self, block_tables: Tensor, seq_index: Tensor, positions: Tensor) -> Tensor:
        # block_tables: [B, W]; seq_index, positions: [T] -> slot of each token: [T] int64
        blocks = block_tables[seq_index, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """-> input_ids [T], positions [T], metadata, index of each sequence's last token in T [B]."""
        block_tables = self._block_table_tensor(batch.block_tables)
        if batch.phase == "decode":
            input_ids = self._tensor([s.last_token for s in batch.seqs])
            context = [s.num_tokens for s in batch.seqs]
            positions = self._tensor(context) - 1
            seq_index = torch.arange(len(batch.seqs), device=self.device)
            meta = AttentionMetadata(
                phase="decode",
                slot_mapping=self._slots(block_tables, seq_index, positions),
                block_tables=block_tables,
                context_lens=self._tensor(context, torch.int32),
            )
            return input_ids, positions, meta, seq_index
        lens = [s.prompt_len for s in batch.seqs]
        input_ids = self._tensor([t for s in batch.seqs for t in s.prompt_ids])
        lens_t = self._tensor(lens)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=self.device)
        cu[1:] = lens_t.cumsum(0)
        # output_size: without it repeat_interleave reads lens_t back to size its output (a GPU sync).
        seq_index = torch.repeat_interleave(
            torch.arange(len(lens), device=self.device), lens_t, output_size=sum(lens)
        )
        positions = torch.arange(sum(lens), device=self.device) - cu[:-1][seq_index]
        meta = AttentionMetadata(
            phase="prefill",
            slot_mapping=self._slots(block_tables, seq_index, positions),
            block_tables=block_tables,
            context_lens=lens_t.to(torch.int32),
            cu_seqlens_q=cu.to(torch.int32),
        )
        return input_ids, positions, meta, cu[1:] - 1

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> Tensor:
        """Run the forward pass, writing the batch's K/V into the pool. -> [B, vocab] float32."""
        g = self.graphs
        if batch.phase == "decode" and g is not None and g.can_run(len(batch.seqs), batch.block_tables):
            return g.run(
                [s.last_token for s in batch.seqs], [s.num_tokens for s in batch.seqs], batch.block_tables
            )
        input_ids, positions, meta, last = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.kv_caches, self.backend)  # [T, hidden]
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        logits = self.compute_logits(batch)
        seqs = batch.seqs
        sampling = SamplingBatch(
            temperatures=[float(s.params.temperature or 0.0) for s in seqs],
            top_ks=[int(s.params.top_k or 0) for s in seqs],
            top_ps=[float(s.params.top_p if s.params.top_p is not None else 1.0) for s in seqs],
            min_ps=[float(s.params.min_p or 0.0) for s in seqs],
            repetition_penalties=[float(s.params.repetition_penalty or 1.0) for s in seqs],
            seen_token_ids=[
                s.prompt_ids + s.output_ids if (s.params.repetition_penalty or 1.0) != 1.0 else []
                for s in seqs
            ],
            seeds=[s.seed for s in seqs],
            steps=[len(s.output_ids) for s in seqs],
        )
        tokens: list[int] = self.sampler(logits, sampling).tolist()
        return tokens
