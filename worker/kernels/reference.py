"""Pure-torch paged attention, written for clarity: the oracle every attention kernel is tested against
(no engine path runs it).

Cache layout (one layer): k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim].
A token's slot is block_id * block_size + offset; block_tables map each sequence's logical
blocks to physical ones. Query heads = kv_heads * group (GQA); head h reads kv head h // group.

Every attention function takes a layer's two optional variants, as Hugging Face computes them:
- window: a sliding window of that many keys, the query's own included (a query at position p sees
  keys p - window + 1 .. p; transformers' mask `kv_idx > q_idx - sliding_window`); None: every key;
- softcap: attention-logit soft-capping (Gemma 2), scores = softcap * tanh(scores / softcap) after the
  softmax scale and before the mask and the softmax; None: none.
Block table entries wholly before every query's window may name any block (the engine releases those
blocks): nothing reads them.
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


def _gather(cache: Tensor, block_table: Tensor, first: int, length: int) -> Tensor:
    # the keys of positions first * block_size .. length - 1 -> [length - first * block_size, kv_heads, head_dim]
    bs = cache.shape[1]
    nblk = (length + bs - 1) // bs
    return cache[block_table[first:nblk].long()].flatten(0, 1)[: length - first * bs]


def _first_block(earliest_query: int, window: int | None, block_size: int) -> int:
    """The first block a sequence's queries read: the one holding the earliest query's first key."""
    return 0 if window is None else max(0, earliest_query - window + 1) // block_size


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    offset: int,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    # q: [Lq, H, D]; k, v: [Lk, KVH, D] -> [Lq, H, D]; math in float32. Query i sits at position offset + i
    # and sees the keys at positions (offset + i - window, offset + i].
    h, kvh = q.shape[1], k.shape[1]
    group = h // kvh
    qf = q.float().transpose(0, 1)  # [H, Lq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    lq, lk = q.shape[0], k.shape[0]
    qpos = torch.arange(lq, device=q.device).unsqueeze(1) + offset
    kpos = torch.arange(lk, device=q.device).unsqueeze(0)
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # one more logit per head in the denominator, its probability dropped (gpt-oss)
        sink = sinks.float().view(h, 1, 1).expand(h, lq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)  # [H, Lq, D]
    return out.transpose(0, 1).to(q.dtype)


def paged_decode_attention(
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
    """One new query token per sequence, attending over its cached context (itself included), the last
    `window` tokens of it where a window is given; sinks: [heads], a logit per head in every softmax's
    denominator (gpt-oss's attention sinks), or None.

    q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] int32;
    context_lens: [batch] int32, tokens in the cache for each sequence -> [batch, heads, head_dim].
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        first = _first_block(n - 1, window, k_cache.shape[1])
        k = _gather(k_cache, block_tables[b], first, n)
        v = _gather(v_cache, block_tables[b], first, n)
        offset = n - 1 - first * k_cache.shape[1]
        out[b] = _attend(q[b : b + 1], k, v, scale, offset, window, softcap, sinks)[0]
    return out


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention for packed new tokens of several sequences, over their cached prefix and themselves
    (within `window` where given).

    q: [new_tokens, heads, head_dim], sequences packed back to back, no padding;
    cu_seqlens_q: [batch + 1] int32 offsets into q; context_lens: [batch] int32, the total tokens of each
    sequence in the cache (cached prefix + new, the new K/V already written). The i-th new token of
    sequence b sits at position context_lens[b] - q_len_b + i. -> [new_tokens, heads, head_dim]
    """
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.shape[0] - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(context_lens[b])
        first = _first_block(n - (e - s), window, k_cache.shape[1])
        k = _gather(k_cache, block_tables[b], first, n)
        v = _gather(v_cache, block_tables[b], first, n)
        offset = n - (e - s) - first * k_cache.shape[1]
        out[s:e] = _attend(q[s:e], k, v, scale, offset, window, softcap, sinks)
    return out
