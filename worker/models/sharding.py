"""Tensor parallelism's split of a decoder over the ranks of a group (Megatron's): each rank holds its share
of the attention heads (q/k/v column-parallel, o row-parallel), of the MLP's intermediate rows (gate/up
column-parallel, down row-parallel) and of the vocabulary (the embedding's rows and the LM head's outputs).
A row-parallel projection's partial outputs are summed over the ranks; the logits are gathered.

KV heads are split where they divide among the ranks, and replicated where there are fewer of them than
ranks (each rank keeps the one its query heads read). What a rank reads of a checkpoint tensor is a `Shard`.

A quantised linear is split in batchq's form (quant_loading.py, gguf_weights.py: q [out, in] unpacked, an
(s, o) table per group of inputs), never in its packed words, so only its groups bound a split: output rows
split anywhere, a row-parallel projection's inputs only into whole groups (`row_parallel_groups`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.models.spec import DecoderSpec

ROW_PARALLEL = ("o_proj", "down_proj")  # split by their inputs, their partial outputs summed over the ranks


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


def row_parallel_groups(module: str, fmt: str, group: int, inputs: int, size: int) -> None:
    """Refuse a row-parallel projection quantised in groups of `group` input rows (`module`: Hugging Face's
    name; fmt: its format) whose share of a rank, `inputs` of them, is not whole groups."""
    if inputs % group:
        raise ShardingError(
            f"tensor_parallel_size {size}: quantised module {module!r} ({fmt}, groups of {group} input rows): "
            f"its {inputs * size} inputs give {inputs} a rank, not whole groups; use tensor_parallel_size = 1"
        )


def act_order_share(module: str, perm: Tensor, rank: int, size: int) -> Tensor:
    """Rank `rank`'s share of a row-parallel projection's act-order input order (GPTQ's g_idx, as the
    permutation `perm` that sorts the input rows by group): the order of its own inputs. A row-parallel split
    keeps whole groups, so each group's rows must lie in one rank's inputs, and the groups in rank order:
    where act-order scattered them (as GPTQ's desc_act does, by the Hessian), ShardingError."""
    k = perm.shape[0]
    n = k // size
    if not torch.equal(perm // n, torch.arange(k, device=perm.device) // n):
        raise ShardingError(
            f"tensor_parallel_size {size}: quantised module {module!r} (GPTQ act-order): its g_idx groups input "
            "rows of more than one rank's share, which a row-parallel split cannot; use a checkpoint without "
            "desc_act, or tensor_parallel_size = 1"
        )
    return perm[rank * n : rank * n + n] - rank * n


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


def decoder_shards(
    name: str, module: str, t: Tensor, rank: int, size: int, full: DecoderSpec, local: DecoderSpec
) -> dict[str, Shard]:
    """What rank `rank` of `size` takes of the checkpoint tensors behind the decoder's parameter `name` (`t`,
    of module `module`), by the module or part name they have in the checkpoint. full: the checkpoint's
    DecoderSpec; local: the rank's (shard_spec)."""
    d, hidden, tail = full.head_dim, full.hidden_size, tuple(t.shape[1:])
    kind = name.rsplit(".", 1)[-1]  # weight or bias
    if module == "qkv_proj":
        q, kv = local.num_heads * d, local.num_kv_heads * d
        q_all, kv_all = full.num_heads * d, full.num_kv_heads * d
        k0, _ = kv_heads(full, rank, size)
        qs, ks = (rank * q, rank * q + q), (k0 * d, k0 * d + kv)
        return {
            "q_proj": Shard((q_all, *tail), 0, (qs,)),
            "k_proj": Shard((kv_all, *tail), 0, (ks,)),
            "v_proj": Shard((kv_all, *tail), 0, (ks,)),
            "qkv_proj": Shard((q_all + 2 * kv_all, *tail), 0,
                              (qs, (q_all + ks[0], q_all + ks[1]), (q_all + kv_all + ks[0], q_all + kv_all + ks[1]))),
        }  # fmt: skip
    if module == "gate_up_proj":  # the dense MLP's or a shared expert's: its size from the tensor
        i = t.shape[0] // 2
        i_all, span = i * size, (rank * i, rank * i + i)
        return {
            "gate_proj": Shard((i_all, *tail), 0, (span,)),
            "up_proj": Shard((i_all, *tail), 0, (span,)),
            "gate_up_proj": Shard((2 * i_all, *tail), 0, (span, (i_all + span[0], i_all + span[1]))),
        }
    if module in ROW_PARALLEL and kind in ("weight", "group_table"):
        # the rank's input columns: of a quantised weight, its q's and its whole groups' (s, o) (every
        # rank's share is whole groups: LlamaFamilyModel.prepare_quantized refuses where it is not)
        n = t.shape[1]
        return {module: Shard((hidden, n * size, *t.shape[2:]), 1, ((rank * n, rank * n + n),))}
    if module in ("lm_head", "embed_tokens") and kind in ("weight", "group_table", "scale"):
        rows, vocab = vocab_rows(full.vocab_size, size), full.vocab_size
        span = (min(rank * rows, vocab), min(rank * rows + rows, vocab))
        return {module: Shard((vocab, *tail), 0, (span,), rows)}
    if module == "self_attn" and kind == "sinks":
        h = local.num_heads
        return {module: Shard((full.num_heads,), 0, ((rank * h, rank * h + h),))}
    return {}
