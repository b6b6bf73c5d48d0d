"""Tensor parallelism's split of a decoder over the ranks of a group (Megatron's): each rank holds its share
of the attention heads (q/k/v column-parallel, o row-parallel), of the MLP's intermediate rows (gate/up
column-parallel, down row-parallel) and of the vocabulary (the embedding's rows and the LM head's outputs).
A row-parallel projection's partial outputs are summed over the ranks; the logits are gathered.

KV heads are split where they divide among the ranks, and replicated where there are fewer of them than
ranks (each rank keeps the one its query heads read). What a rank reads of a checkpoint tensor is a `Shard`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.models.spec import DecoderSpec


class ShardingError(ValueError):
    """A model that cannot be split over the group as asked (the message says why)."""


def shard_spec(spec: DecoderSpec, size: int) -> DecoderSpec:
    """One rank's decoder of a group of `size`: its heads, KV heads and intermediate rows (the vocabulary is
    split apart, `vocab_rows`). Raises ShardingError where the model does not divide."""
    h, kv, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    if h % size:
        raise ShardingError(
            f"tensor_parallel_size {size}: the model's {h} attention heads do not divide by it"
        )
    if kv % size and size % kv:
        raise ShardingError(
            f"tensor_parallel_size {size}: the model's {kv} KV heads neither divide by it nor divide it"
        )
    dense = spec.moe is None or not all(spec.moe.sparse_layers)
    if dense and inter % size:
        raise ShardingError(
            f"tensor_parallel_size {size}: the MLP's intermediate size {inter} does not divide by it"
        )
    if spec.qk_norm_over_projection:
        raise ShardingError("tensor parallelism does not split OLMo 2's norms over whole q / k projections")
    moe = spec.moe
    if moe is not None:  # every expert split as a dense MLP is (tensor parallel inside each expert)
        shared = moe.shared_intermediate
        for what, n in (("experts' intermediate size", moe.intermediate_size), ("shared expert's", shared)):
            if n is not None and n % size:
                raise ShardingError(f"tensor_parallel_size {size}: the {what} {n} does not divide by it")
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // size,
            shared_intermediate=shared and shared // size,
        )
    return dataclasses.replace(
        spec, num_heads=h // size, num_kv_heads=max(1, kv // size), intermediate_size=inter // size, moe=moe
    )


def vocab_rows(vocab: int, size: int) -> int:
    """The vocabulary rows each rank holds (the last rank's share padded with zero rows)."""
    return -(-vocab // size)


def kv_heads(spec: DecoderSpec, rank: int, size: int) -> tuple[int, int]:
    """The KV heads [first, end) rank `rank` holds: its share, or the one its query heads read."""
    kv = spec.num_kv_heads
    if kv % size == 0:
        per = kv // size
        return rank * per, (rank + 1) * per
    head = rank // (size // kv)
    return head, head + 1


@dataclass(frozen=True)
class Shard:
    """What one rank takes of a checkpoint tensor: the spans [a, b) of dimension `dim`, in order and joined,
    padded with zero rows to `rows` where given (the vocabulary's last share). `full`: the tensor's shape."""

    full: tuple[int, ...]
    dim: int
    spans: tuple[tuple[int, int], ...]
    rows: int | None = None

    def take(self, w: Tensor) -> Tensor:
        parts = [w.narrow(self.dim, a, b - a) for a, b in self.spans]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        if self.rows is not None and out.shape[0] < self.rows:
            pad = out.new_zeros((self.rows - out.shape[0], *out.shape[1:]))
            out = torch.cat([out, pad])
        return out
