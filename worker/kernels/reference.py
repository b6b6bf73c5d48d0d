"""Pure-torch paged attention, written for clarity: the oracle every attention kernel is tested against
(no engine path runs it).

Cache layout (one layer): k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim].
A token's slot is block_id * block_size + offset; block_tables map each sequence's logical
blocks to physical ones. Query heads = kv_heads * group (GQA); head h reads kv head h // group.
"""

from __future__ import annotations

import torch
from torch import Tensor


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new keys/values into their slots.

    k, v: [tokens, kv_heads, head_dim]; slot_mapping: [tokens] int64.
    """
    nb, bs, kvh, d = k_cache.shape
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    # -> [length, kv_heads, head_dim]
    bs = cache.shape[1]
    nblk = (length + bs - 1) // bs
    return cache[block_table[:nblk].long()].flatten(0, 1)[:length]


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, causal_offset: int | None) -> Tensor:
    # q: [Lq, H, D]; k, v: [Lk, KVH, D] -> [Lq, H, D]; math in float32.
    h, kvh = q.shape[1], k.shape[1]
    group = h // kvh
    qf = q.float().transpose(0, 1)  # [H, Lq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Lq, Lk]
    if causal_offset is not None:
        lq, lk = q.shape[0], k.shape[0]
        qpos = torch.arange(lq, device=q.device).unsqueeze(1) + causal_offset
        kpos = torch.arange(lk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, Lq, D]
    return out.transpose(0, 1).to(q.dtype)


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """One new query token per sequence, attending over its whole cached context (itself included).

    q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] int32;
    context_lens: [batch] int32, tokens in the cache for each sequence -> [batch, heads, head_dim].
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = _gather(k_cache, block_tables[b], n)
        v = _gather(v_cache, block_tables[b], n)
        out[b] = _attend(q[b : b + 1], k, v, scale, None)[0]
    return out


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """Causal attention for packed new tokens of several sequences, over their cached prefix and themselves.

    q: [new_tokens, heads, head_dim], sequences packed back to back, no padding;
    cu_seqlens_q: [batch + 1] int32 offsets into q; context_lens: [batch] int32, the total tokens of each
    sequence in the cache (cached prefix + new, the new K/V already written). The i-th new token of
    sequence b sits at position context_lens[b] - q_len_b + i. -> [new_tokens, heads, head_dim]
    """
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.shape[0] - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(context_lens[b])
        k = _gather(k_cache, block_tables[b], n)
        v = _gather(v_cache, block_tables[b], n)
        out[s:e] = _attend(q[s:e], k, v, scale, causal_offset=n - (e - s))
    return out
