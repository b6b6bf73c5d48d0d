"""The torch attention backend: paged attention in torch ops, on any device (the CPU path, and CUDA when
Triton is unavailable or not asked for); on the CPU, decode and float32 prefill run in C
(native_attention.py) where the backend turns the C kernels on.

Cache layout (one layer): k_cache, v_cache: [kv_heads, num_blocks, block_size, head_dim], kv-head
outermost (reference.py and the Triton kernels use [num_blocks, block_size, kv_heads, head_dim]).
Gathering a sequence's blocks is then one contiguous-row index_select per kv head, and the result is
already [kv_heads, seqs, tokens, head_dim], the layout the batched matmuls read without a copy.

Decode runs the C kernel of native_attention.py where the backend says (native=True): it reads each
block in place. The torch path below is its fallback (no compiler, cpu_kernels = "torch", an unsupported
shape).
It gathers a length-sorted group of sequences at a time into a reused workspace (no allocation, no
page faults per step), then computes the group's attention as two batched matmuls around a softmax,
with the kv heads as the batch dimension and each sequence's query heads of one kv head as its query
rows, so grouped-query heads never copy K/V. Attention computes in q's (the model's) dtype: a cache
narrower than that (kv_cache_dtype) widens as it is read. Scores are rounded to that dtype before the
softmax, which runs in float32 inside (HF's eager attention does the same). SDPA's flash kernel is slower
here: its tiles do only a few query rows of work per call at decode.
Prefill attends over each sequence's own K/V from this step (nothing read back from the cache) unless
the sequence continues a cached prefix: in float32 with the C kernel (prefill_attention.c, with the C
kernels on) or one causal SDPA call, in bf16/fp16 (and wherever a layer has a sliding window or
soft-capping) as causal tiles of batched matmuls (causal_tiles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.kernels import native_attention
from worker.kernels.cascade import CascadePlanner, cascade_decode
from worker.kernels.causal_tiles import TILE_ROWS, causal_tiles, first_block, with_sinks

MAX_GROUP = 64  # sequences per padded group
WORKSPACE_BYTES = 64 << 20  # per K and per V; a group that needs more is split


def kv_cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (kv_heads, num_blocks, block_size, head_dim)


def length_groups(lens: list[int], block_size: int, max_group: int = MAX_GROUP) -> list[list[int]]:
    """Sequence indices sorted by length, cut into groups whose padding stays within ~25% + one block."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < max_group and lens[i] <= 1.25 * lens[groups[-1][0]] + block_size:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class _Chunk:
    """Sequences order[start : start + n] of a decode plan, padded to `tokens` and gathered together."""

    start: int
    n: int
    tokens: int
    blocks: Tensor  # [KVH * n * nblk] rows of the cache viewed [KVH * num_blocks, block_size, D]
    stale_rows: Tensor  # token rows of the gathered [KVH * n * tokens, D] that lie past a context
    masked: Tensor  # [1, n, 1, tokens] bool: True past a context


@dataclass
class _DecodePlan:
    context_lens: Tensor  # copies of the step's metadata this plan was built for
    block_tables: Tensor
    layout: tuple[object, ...]  # cache shape and dtype, and the window
    order: Tensor  # [B] sequence indices, grouped
    inverse: Tensor  # [B] position of each sequence in `order`
    chunks: list[_Chunk]


def head_rows(rows: Tensor, kv_heads: int, per_head: int) -> Tensor:
    """Rows [M] within one kv head's slice -> rows [KVH * M] of a tensor whose first dimension holds the
    kv heads' slices of `per_head` rows one after another, head-major. E.g. block ids -> rows of a cache
    viewed [KVH * num_blocks, block_size, D]."""
    offsets = torch.arange(kv_heads, device=rows.device).view(kv_heads, 1) * per_head
    return (rows.long().view(1, -1) + offsets).view(-1)


class TorchAttention:
    """write_kv / paged_decode_attention / paged_prefill_attention over the kv-head-major layout.

    One instance per model runner: it owns the gather workspace, grown on demand up to WORKSPACE_BYTES.
    With native=True, decode on the CPU runs the C kernel (native_attention.py) where it handles the
    shapes.
    """

    def __init__(self, native: bool, workspace_bytes: int = WORKSPACE_BYTES, invariant: bool = False) -> None:
        self.workspace_bytes = workspace_bytes
        self.native = native
        # invariant: a sequence's decode attention never depends on the sequences beside it. Cascade's
        # shared-prefix half is a GEMM over every member's rows, and a padded group's matmuls sum over the
        # group's longest context: both follow the neighbours, so each sequence then attends on its own.
        self.invariant = invariant
        self.max_group = 1 if invariant else MAX_GROUP
        self._ws: dict[str, Tensor] = {}
        # one plan per window: a model's windowed and full layers alternate within a step (Gemma)
        self._plans: dict[int | None, _DecodePlan] = {}
        self._cascade = CascadePlanner()

    kv_cache_shape = staticmethod(kv_cache_shape)

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._ws.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._ws[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

    def _gather(self, name: str, cache: Tensor, blocks: Tensor, tokens: int) -> Tensor:
        """cache [KVH, NB, BS, D], blocks [N * nblk] -> [KVH, N, nblk * BS, D] (workspace view)."""
        kvh, nb, bs, d = cache.shape
        rows = head_rows(blocks, kvh, nb)
        out = self._buffer(name, (rows.numel(), bs, d), cache)
        torch.index_select(cache.view(kvh * nb, bs, d), 0, rows, out=out)
        return out.view(kvh, -1, tokens, d)

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim]; slot_mapping: [tokens] int64 (block * block_size + offset).
        With native=True, float32 K/V on the CPU go in one C pass (native_attention.write_kv): the same
        bytes as the torch ops below."""
        if self.native and native_attention.write_kv(k, v, k_cache, v_cache, slot_mapping):
            return
        kvh, nb, bs, d = k_cache.shape
        for x, cache in ((k, k_cache), (v, v_cache)):
            rows = x.transpose(0, 1).to(cache.dtype)  # an FP8 cast saturates at the format's largest value
            if cache.dtype.itemsize == 1:  # torch has no index_copy_ for FP8: copy the bytes
                cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
            cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, rows)

    def _decode_plan(
        self, k_cache: Tensor, block_tables: Tensor, context_lens: Tensor, window: int | None
    ) -> _DecodePlan:
        """Groups, gather indices and masks for one decode step, built once and reused by every layer of
        the same window.

        The plan depends only on context_lens, block_tables, the cache layout and the window, which every
        such layer of a step shares: it is rebuilt when their values change (comparing them costs
        microseconds). A sequence's gather starts at the block of its window's first key (first_block) and
        its slots before that key are masked like those past its context.
        """
        plan = self._plans.get(window)
        layout = (*k_cache.shape, k_cache.dtype, window)
        if (
            plan is not None
            and plan.layout == layout
            and torch.equal(plan.context_lens, context_lens)
            and torch.equal(plan.block_tables, block_tables)
        ):
            return plan
        kvh, nb, bs, d = k_cache.shape
        dev = k_cache.device
        lens = context_lens.tolist()
        firsts = [first_block(n - 1, window, bs) for n in lens]
        spans = [n - f * bs for n, f in zip(lens, firsts, strict=True)]  # tokens from the first block read
        width = block_tables.shape[1]
        per_token = kvh * d * k_cache.element_size()
        chunks: list[_Chunk] = []
        order: list[int] = []
        for group in length_groups(spans, bs, self.max_group):
            nblk = -(-spans[group[-1]] // bs)
            step = max(1, self.workspace_bytes // (nblk * bs * per_token))
            for i in range(0, len(group), step):
                chunk = group[i : i + step]
                n, tokens = len(chunk), nblk * bs
                idx = torch.tensor(chunk, device=dev)
                first = torch.tensor([firsts[j] for j in chunk], device=dev).unsqueeze(1)  # [n, 1]
                # a shorter span's columns past its table read some block; those slots are masked
                cols = (first + torch.arange(nblk, device=dev)).clamp_(max=width - 1)
                blocks = block_tables[idx.unsqueeze(1), cols].reshape(-1)  # [n * nblk]
                pos = torch.arange(tokens, device=dev) + first * bs  # [n, L] each slot's position
                ctx = context_lens[idx].unsqueeze(1)
                valid = pos < ctx
                if window is not None:
                    valid &= pos >= ctx - window
                stale = (~valid).view(1, -1).nonzero()[:, 1]  # rows outside a window, within one head
                rows = head_rows(stale, kvh, n * tokens)  # the same rows in every head's slice
                chunks.append(
                    _Chunk(len(order), n, tokens, head_rows(blocks, kvh, nb), rows, ~valid[None, :, None, :])
                )
                order += chunk
        order_t = torch.tensor(order, device=dev)
        inverse = torch.empty_like(order_t)
        inverse[order_t] = torch.arange(len(order), device=dev)
        plan = _DecodePlan(context_lens.clone(), block_tables.clone(), layout, order_t, inverse, chunks)
        self._plans[window] = plan
        return plan

    def plain_native_decode(
        self, k_cache: Tensor, block_tables: Tensor, context_lens: Tensor, widest: int | None = None
    ) -> bool:
        """Whether paged_decode_attention would run the C kernel alone in every layer this step (no cascade
        over a shared prefix, which is faster where it applies): the model's C decode stack runs that same
        kernel. widest: the largest window of the model's layers, None where some layer sees every key;
        cascade runs only in a layer whose window covers every context."""
        if not self.native or not native_attention.cache_supported(k_cache):
            return False
        if self.invariant or (widest is not None and widest < int(context_lens.max())):
            return True
        return not self._cascade.plan(block_tables, context_lens, k_cache.shape[2]).groups

    def paged_decode_attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] int32; context_lens: [batch].
        window, softcap: reference.py's; sinks: [heads], a logit per head in the softmax's denominator
        (gpt-oss: the C kernel's output rescaled by its log-sum-exp, or the torch ops). -> [batch, heads,
        head_dim]

        Sequences are sorted by length and cut into groups of similar length, each padded only to its
        own longest context, so a few long contexts do not make every short one pay for their padding.
        """
        if self.native and sinks is not None and native_attention.supports(q, k_cache):
            o = native_attention.paged_decode(
                q,
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )
            if o is not None:
                return o
        if self.native and sinks is None and native_attention.supports(q, k_cache):
            out = None
            # cascade's shared prefix is seen whole by every member: not where a window cuts a context
            if not self.invariant and (window is None or window >= int(context_lens.max())):
                shared = self._cascade.plan(block_tables, context_lens, k_cache.shape[2])
                if shared.groups:
                    out = cascade_decode(q, k_cache, v_cache, shared, scale, softcap)
                    if out is not None:
                        return out
            out = native_attention.paged_decode(
                q, k_cache, v_cache, block_tables, context_lens, scale, window=window, softcap=softcap
            )
            if out is not None:
                return out
        b, h, d = q.shape
        kvh, nb, bs, _ = k_cache.shape
        g = h // kvh
        plan = self._decode_plan(k_cache, block_tables, context_lens, window)
        q_sorted = q.index_select(0, plan.order) * scale
        out_sorted = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
        k_rows, v_rows = k_cache.view(kvh * nb, bs, d), v_cache.view(kvh * nb, bs, d)
        for c in plan.chunks:
            size = (c.blocks.numel(), bs, d)
            k = torch.index_select(k_rows, 0, c.blocks, out=self._buffer("k", size, k_cache))
            v = torch.index_select(v_rows, 0, c.blocks, out=self._buffer("v", size, v_cache))
            # Slots outside a window hold another request's stale V (or padding blocks): zero them, since
            # 0 * NaN in P @ V is NaN. Their scores need no such care: masked_fill_ overwrites a NaN.
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache narrower than the compute dtype widens here
            v.view(-1, d).index_fill_(0, c.stale_rows, 0)
            qg = q_sorted[c.start : c.start + c.n].view(c.n, kvh, g, d).transpose(0, 1)  # [KVH, n, G, D]
            scores = torch.matmul(qg, k.view(kvh, c.n, c.tokens, d).transpose(-1, -2))  # [KVH, n, G, T]
            if softcap is not None:
                scores = torch.tanh(scores / softcap).mul_(softcap)
            scores = scores.masked_fill_(c.masked, float("-inf"))
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:
                probs = with_sinks(scores.view(kvh, c.n * g, -1), sinks, c.n, g).view(scores.shape)
            o = torch.matmul(probs, v.view(kvh, c.n, c.tokens, d))  # [KVH, n, G, D]
            out_sorted[c.start : c.start + c.n] = o.transpose(0, 1).reshape(c.n, h, d)
        return out_sorted.index_select(0, plan.inverse)

    def _prefill_as_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        i: int,
        s: int,
        e: int,
        n: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: Tensor | None,
        out: Tensor,
    ) -> bool:
        """Under batch invariance, a window's, a softcap's or a sink's prompt rows (which causal_tiles would
        compute as GEMMs whose sums follow the tile's rows and keys) as decode rows of paged_decode.c over
        the cache, which this step's K/V are already in: each row sums in one fixed order, the same whether
        it is prefilled alone, chunked, after a cached prefix, or decoded. False where the kernel does not
        take the shapes."""
        if not (self.native and native_attention.supports(q, k_cache)):
            return False
        rows = e - s
        tables = block_tables[i : i + 1].expand(rows, -1)
        lens = torch.arange(n - rows + 1, n + 1, dtype=torch.int32, device=q.device)
        o = native_attention.paged_decode(
            q[s:e], k_cache, v_cache, tables, lens, scale, window=window, softcap=softcap, sinks=sinks
        )
        if o is None:
            return False
        out[s:e] = o
        return True

    def paged_prefill_attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        cu_seqlens_q: Tensor,
        context_lens: Tensor,
        scale: float,
        k: Tensor | None = None,
        v: Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """q: [new_tokens, heads, head_dim] packed; cu_seqlens_q: [batch + 1]; context_lens: [batch].

        k, v: this step's new keys/values [new_tokens, kv_heads, head_dim] (already written to the
        cache); a sequence without a cached prefix attends to them directly. window, softcap:
        reference.py's (then causal_tiles in every dtype: SDPA computes neither, and its mask would not
        skip the keys before the window). -> [new_tokens, heads, head_dim]
        """
        h = q.shape[1]
        kvh, _, bs, _ = k_cache.shape
        tiled = q.dtype != torch.float32
        plain = window is None and softcap is None and sinks is None
        out = torch.empty_like(q)
        starts = cu_seqlens_q.tolist()
        lens = context_lens.tolist()
        for i, n in enumerate(lens):
            s, e = starts[i], starts[i + 1]
            if self.invariant and not plain and self._prefill_as_decode(q, k_cache, v_cache, block_tables, i,
                                                                        s, e, n, scale, window, softcap, sinks, out):  # fmt: skip
                continue
            first = 0
            if e - s == n and k is not None and v is not None:
                # rounded as the cache holds them, so a prompt attends to the same K/V in one step or in
                # chunks that read the earlier ones back
                ki = k[s:e].transpose(0, 1).to(k_cache.dtype).to(q.dtype)  # [KVH, n, D]
                vi = v[s:e].transpose(0, 1).to(v_cache.dtype).to(q.dtype)
            else:
                first = first_block(n - (e - s), window, bs)  # blocks before it: outside every window
                nblk = -(-n // bs) - first
                blocks = block_tables[i, first : first + nblk]
                keys = n - first * bs
                ki = self._gather("k", k_cache, blocks, nblk * bs)[:, 0, :keys].to(q.dtype)  # [KVH, keys, D]
                vi = self._gather("v", v_cache, blocks, nblk * bs)[:, 0, :keys].to(q.dtype)
            offset = n - (e - s) - first * bs  # the first query's position among the keys read
            if not plain or (tiled and e - s >= TILE_ROWS // 2):
                out[s:e] = causal_tiles(q[s:e], ki, vi, offset, scale, window, softcap, sinks)
                continue
            native = self.native and native_attention.prefill_supported(q[s:e], ki, vi)
            if native and native_attention.prefill(q[s:e], ki, vi, offset, scale, out=out[s:e]) is not None:
                continue
            qi = q[s:e].transpose(0, 1)  # [H, q_len, D]
            # 4-D inputs: CPU SDPA only takes its fused flash kernel for [batch, heads, len, dim].
            if e - s == n:
                o = F.scaled_dot_product_attention(
                    qi[None], ki[None], vi[None], is_causal=True, scale=scale, enable_gqa=h != kvh
                )
            else:
                # query j sits at position n - q_len + j (causal over the cached prefix and itself)
                qpos = torch.arange(n - (e - s), n, device=q.device).unsqueeze(1)
                mask = torch.arange(n, device=q.device).unsqueeze(0) <= qpos
                o = F.scaled_dot_product_attention(
                    qi[None], ki[None], vi[None], attn_mask=mask, scale=scale, enable_gqa=h != kvh
                )
            out[s:e] = o[0].transpose(0, 1)
        return out
