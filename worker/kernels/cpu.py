"""Faster pure-torch paged attention for the CPU path, same signatures as reference.py.

Decode gathers sequences' blocks a length-sorted group at a time (a handful of groups per layer, never
one op per sequence) and scores grouped-query heads with block-diagonal bmms.
Prefill loops over sequences (one SDPA call each, causal), never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_GROUP = 64  # sequences per padded group


def _length_groups(lens: list[int], block_size: int) -> list[list[int]]:
    """Sequence indices sorted by length, cut into groups whose padding stays within ~25% + one block."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < MAX_GROUP and lens[i] <= 1.25 * lens[groups[-1][0]] + block_size:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] int32; context_lens: [batch] int32.

    -> [batch, heads, head_dim]

    Sequences are sorted by length and cut into groups of similar length, each padded only to its own
    longest context, so a few long contexts do not make every short one pay for their padding, while
    many similar contexts share one gather and one bmm.
    Grouped-query heads never copy K/V per query head: each group's queries form a block-diagonal
    [kv_heads * group, kv_heads * head_dim] matrix, so one bmm against the gathered [len, kv_heads *
    head_dim] rows scores every head at once (the zero blocks cost FLOPs, not memory traffic, and
    decode attention is bound by memory traffic).
    """
    _, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    lens = context_lens.tolist()
    eye = torch.eye(kvh, dtype=q.dtype, device=q.device)
    out = torch.empty_like(q)
    for chunk in _length_groups(lens, bs):
        n = len(chunk)
        nblk = -(-lens[chunk[-1]] // bs)
        idx = torch.tensor(chunk, device=q.device)
        tables = block_tables[idx, :nblk].long()
        k = k_cache[tables].view(n, nblk * bs, kvh * d)  # [n, L, KVH*D]
        v = v_cache[tables].view(n, nblk * bs, kvh * d)
        qbd = (eye.view(1, kvh, 1, kvh, 1) * q[idx].to(k.dtype).view(n, kvh, g, 1, d)).reshape(
            n, kvh * g, kvh * d
        )
        scores = torch.bmm(qbd, k.transpose(1, 2)).float() * scale  # [n, KVH*G, L]
        pad = torch.arange(nblk * bs, device=q.device) >= context_lens[idx].unsqueeze(1)
        scores.masked_fill_(pad.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.bmm(probs, v).view(n, kvh, g, kvh, d)  # every head against every kv head
        out[idx] = torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, h, d).to(q.dtype)
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
