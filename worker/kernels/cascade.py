"""Cascade decode attention: sequences that share cached prefix blocks attend to them together.

With the prefix cache, the requests of a labeling batch hold the very same physical blocks for their
shared instruction and examples. Attention splits exactly over disjoint key sets: over the shared prefix
for every sequence of the group at once (two batched matmuls), and over each sequence's own blocks (the
C decode kernel, which also returns each row's log-sum-exp); the halves merge by their log-sum-exps:

    lse = logaddexp(lse_prefix, lse_suffix)
    out = out_prefix * exp(lse_prefix - lse) + out_suffix * exp(lse_suffix - lse)

The C kernel computes q.k as a dot product per key row, far below a matmul's rate, where the shared part
becomes a matmul (`python benchmarks/fewshot_bench.py` measures labeling batches with a shared few-shot
prefix). Prefill keeps its per-sequence attention: there the shared part was already a matmul (SDPA's
flash kernel), and splitting it off was slower.
Only keys that every query of the step sees belong to the prefix, so the prefix half needs no mask.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.kernels import native_attention

MIN_SHARED_TOKENS = 64  # a shorter shared prefix is not worth a second pass
ROWS_PER_TILE = 2048  # query rows per kv head in one prefix GEMM (bounds the scores' memory)


@dataclass
class SharedPrefix:
    """Sequences `members` (indices into the step's batch) all begin with `blocks` in their tables."""

    members: list[int]
    num_blocks: int
    blocks: Tensor  # [num_blocks] block ids


def shared_prefixes(tables: list[list[int]], visible: list[int], block_size: int) -> list[SharedPrefix]:
    """Groups of two or more sequences whose tables start with the same blocks.

    tables: each sequence's block table; visible: per sequence, how many of its leading blocks hold
    only keys that all of its queries in this step see (decode: (context - 1) // block_size; prefill:
    (context - new tokens) // block_size). Sequences are grouped by their first MIN_SHARED_TOKENS of
    blocks; a group's prefix is the longest run of blocks all its members share within what they see.
    """
    head = -(-MIN_SHARED_TOKENS // block_size)
    by_head: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, table in enumerate(tables):
        if visible[i] >= head:
            by_head[tuple(table[:head])].append(i)
    groups = []
    for members in by_head.values():
        if len(members) < 2:
            continue
        limit = min(visible[i] for i in members)
        first = tables[members[0]]
        n = head
        while n < limit and all(tables[i][n] == first[n] for i in members):
            n += 1
        groups.append(SharedPrefix(members, n, torch.tensor(first[:n], dtype=torch.long)))
    return groups


def prefix_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor, scale: float, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of query rows over the keys of `blocks`, no mask.

    q: [KVH, R, D] (each kv head's query rows); caches [KVH, NB, BS, D]; blocks: [P] block ids.
    softcap: attention-logit soft-capping of the scaled scores (reference.py).
    -> out [KVH, R, D] float32, lse [KVH, R] float32 (log-sum-exp of the scaled (capped) scores).
    The matmuls run in q's dtype (a narrower cache widens as it is read), the softmax in float32.
    """
    kvh, _, _, d = k_cache.shape
    dt = q.dtype
    kp = k_cache.index_select(1, blocks.to(k_cache.device)).reshape(kvh, -1, d).to(dt)  # [KVH, T, D]
    vp = v_cache.index_select(1, blocks.to(v_cache.device)).reshape(kvh, -1, d).to(dt)
    kt = kp.transpose(1, 2)
    rows = q.shape[1]
    out = torch.empty(kvh, rows, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(kvh, rows, dtype=torch.float32, device=q.device)
    for a in range(0, rows, ROWS_PER_TILE):
        b = min(rows, a + ROWS_PER_TILE)
        scores = torch.bmm(q[:, a:b].to(dt), kt).float().mul_(scale)  # [KVH, r, T]
        if softcap is not None:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        m = scores.amax(dim=-1, keepdim=True)
        p = scores.sub_(m).exp_()
        s = p.sum(dim=-1, keepdim=True)
        out[:, a:b] = torch.bmm(p.to(dt), vp).float().div_(s)
        lse[:, a:b] = (m + s.log()).squeeze(-1)
    return out, lse


def merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Attention over two disjoint key sets -> attention over their union. o: [..., D], lse: [...]."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * (lse1 - lse).exp().unsqueeze(-1) + o2 * (lse2 - lse).exp().unsqueeze(-1)


@dataclass
class CascadePlan:
    """The shared prefixes of one decode step, built once and reused by every layer."""

    block_tables: Tensor
    context_lens: Tensor
    groups: list[SharedPrefix]
    index: list[Tensor]  # per group: its members as a tensor
    suffix_tables: Tensor  # every sequence's table without its group's shared blocks
    suffix_lens: Tensor  # every sequence's context without its group's shared tokens


class CascadePlanner:
    """Builds a step's CascadePlan once; every layer of the step gets the same one."""

    def __init__(self) -> None:
        self._plan: CascadePlan | None = None
        self.shared_steps = 0  # steps that found a shared prefix (tests, profiling)

    def plan(self, block_tables: Tensor, context_lens: Tensor, block_size: int) -> CascadePlan:
        plan = self._plan
        if (
            plan is not None
            and torch.equal(plan.context_lens, context_lens)
            and torch.equal(plan.block_tables, block_tables)
        ):
            return plan
        tables = block_tables.tolist()
        lens = context_lens.tolist()
        # A decode query sees every cached key: the shared part may reach the block before its own.
        groups = shared_prefixes(tables, [(n - 1) // block_size for n in lens], block_size)
        self.shared_steps += bool(groups)
        skip = [0] * len(lens)
        for grp in groups:
            for i in grp.members:
                skip[i] = grp.num_blocks
        dev = block_tables.device
        self._plan = CascadePlan(
            block_tables.clone(),
            context_lens.clone(),
            groups,
            [torch.tensor(grp.members, device=dev) for grp in groups],
            torch.tensor(
                [t[k:] + [0] * k for t, k in zip(tables, skip, strict=True)], dtype=torch.int32, device=dev
            ),
            torch.tensor(
                [n - k * block_size for n, k in zip(lens, skip, strict=True)], dtype=torch.int32, device=dev
            ),
        )
        return self._plan


def cascade_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: CascadePlan, scale: float, softcap: float | None = None
) -> Tensor | None:
    """Decode with the C kernel over every sequence's own blocks, the shared prefixes as matmuls.
    q: [batch, heads, head_dim]; caches [KVH, NB, BS, D]; softcap: reference.py's. No window: a member whose
    window began inside the shared prefix would see a part of it only (the caller keeps such layers off
    this path). -> [batch, heads, head_dim], or None when the C kernel could not allocate its scratch memory."""
    b, h, d = q.shape
    kvh = k_cache.shape[0]
    g = h // kvh
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
    out = native_attention.paged_decode(
        q, k_cache, v_cache, plan.suffix_tables, plan.suffix_lens, scale, lse, softcap=softcap
    )
    if out is None:
        return None
    for grp, idx in zip(plan.groups, plan.index, strict=True):
        n = len(grp.members)
        rows = q.index_select(0, idx).view(n, kvh, g, d).transpose(0, 1).reshape(kvh, n * g, d)
        o1, l1 = prefix_attention(
            rows, k_cache, v_cache, grp.blocks, scale, softcap
        )  # [KVH, n*G, D], [KVH, n*G]
        o1 = o1.view(kvh, n, g, d).transpose(0, 1).reshape(n, h, d)
        l1 = l1.view(kvh, n, g).transpose(0, 1).reshape(n, h)
        out[idx] = merge(o1, l1, out.index_select(0, idx), lse.index_select(0, idx))
    return out.to(q.dtype)
