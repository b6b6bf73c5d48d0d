"""Faster pure-torch paged attention for the CPU path, same signatures as reference.py.

Decode gathers every sequence's blocks in one indexing op (padded to the longest context, masked),
then runs one batched SDPA with grouped-query heads: no Python loop over sequences.
Prefill loops over sequences (one SDPA call each, causal), never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] int32; context_lens: [batch] int32.

    -> [batch, heads, head_dim]
    """
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    nblk = -(-max_len // bs)
    tables = block_tables[:, :nblk].long()
    k = k_cache[tables].view(b, nblk * bs, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[tables].view(b, nblk * bs, kvh, d).transpose(1, 2)
    pos = torch.arange(nblk * bs, device=q.device)
    mask = (pos.unsqueeze(0) < context_lens.unsqueeze(1).long()).view(b, 1, 1, nblk * bs)
    qf = q.unsqueeze(2).to(k.dtype)  # [B, H, 1, D]
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale, enable_gqa=h != kvh)
    return out.squeeze(2).to(q.dtype)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """q: [new_tokens, heads, head_dim] packed; cu_seqlens_q: [batch + 1]; context_lens: [batch].

    -> [new_tokens, heads, head_dim]
    """
    h, d = q.shape[1], q.shape[2]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, n in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        nblk = -(-n // bs)
        table = block_tables[i, :nblk].long()
        k = k_cache[table].view(nblk * bs, kvh, d)[:n].transpose(0, 1)  # [KVH, n, D]
        v = v_cache[table].view(nblk * bs, kvh, d)[:n].transpose(0, 1)
        # 4-D inputs: CPU SDPA only takes its fused flash kernel for [batch, heads, len, dim].
        qi = q[s:e].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, q_len, D]
        k, v = k.unsqueeze(0), v.unsqueeze(0)
        gqa = h != kvh
        if e - s == n:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # cached prefix: query i sits at position n - q_len + i
            qpos = torch.arange(n - (e - s), n, device=q.device).unsqueeze(1)
            mask = torch.arange(n, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out
