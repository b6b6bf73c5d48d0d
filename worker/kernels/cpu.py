"""The CPU attention path: paged attention in pure torch, laid out for cheap gathers.

Cache layout (one layer): k_cache, v_cache: [kv_heads, num_blocks, block_size, head_dim], kv-head
outermost (reference.py and the Triton kernels use [num_blocks, block_size, kv_heads, head_dim]).
Gathering a sequence's blocks is then one contiguous-row index_select per kv head, and the result is
already [kv_heads, seqs, tokens, head_dim], the layout SDPA reads without another copy.

Decode gathers a length-sorted group of sequences at a time into a reused workspace (no allocation, no
page faults per step), then runs one SDPA call per group with the kv heads as the batch dimension and
each sequence's query heads of one kv head as its query rows, so grouped-query heads never copy K/V.
Prefill runs one causal SDPA call per sequence over this step's own K/V (nothing read back from the
cache) unless the sequence continues a cached prefix.
Measured (bf16, 48 sequences of 100-850 tokens, SmolLM2 shapes, 2 cores): 16.8 -> 5.4 ms per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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


class CpuAttention:
    """write_kv / paged_decode_attention / paged_prefill_attention over the kv-head-major layout.

    One instance per model runner: it owns the gather workspace, grown on demand up to WORKSPACE_BYTES.
    """

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.workspace_bytes = workspace_bytes
        self._ws: dict[str, Tensor] = {}

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
        kvh, _, bs, d = cache.shape
        out = self._buffer(name, (kvh, blocks.numel(), bs, d), cache)
        for h in range(kvh):
            torch.index_select(cache[h], 0, blocks, out=out[h])
        return out.view(kvh, -1, tokens, d)

    @staticmethod
    def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim]; slot_mapping: [tokens] int64 (block * block_size + offset)."""
        kvh, nb, bs, d = k_cache.shape
        k_cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(kvh, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))

    def paged_decode_attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        scale: float,
    ) -> Tensor:
        """q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] int32; context_lens: [batch].

        -> [batch, heads, head_dim]

        Sequences are sorted by length and cut into groups of similar length, each padded only to its
        own longest context, so a few long contexts do not make every short one pay for their padding.
        """
        _, h, d = q.shape
        kvh, _, bs, _ = k_cache.shape
        g = h // kvh
        lens = context_lens.tolist()
        per_token = kvh * d * k_cache.element_size()
        out = torch.empty_like(q)
        for group in length_groups(lens, bs):
            nblk = -(-lens[group[-1]] // bs)
            step = max(1, self.workspace_bytes // (nblk * bs * per_token))
            for i in range(0, len(group), step):
                chunk = group[i : i + step]
                n, tokens = len(chunk), nblk * bs
                idx = torch.tensor(chunk, device=q.device)
                blocks = block_tables[idx, :nblk].reshape(-1)
                k = self._gather("k", k_cache, blocks, tokens)  # [KVH, n, L, D]
                v = self._gather("v", v_cache, blocks, tokens)
                valid = torch.arange(tokens, device=q.device) < context_lens[idx].unsqueeze(1)  # [n, L]
                # Slots past a context hold another request's stale K/V (or padding blocks): zero them,
                # since a masked score still turns NaN when K is NaN, and 0 * NaN in P @ V is NaN.
                stale = (~valid).view(-1).nonzero().squeeze(1)
                k.view(kvh, n * tokens, d).index_fill_(1, stale, 0)
                v.view(kvh, n * tokens, d).index_fill_(1, stale, 0)
                qg = q[idx].to(k.dtype).view(n, kvh, g, d).transpose(0, 1)  # [KVH, n, G, D]
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[None, :, None, :], scale=scale)
                out[idx] = o.transpose(0, 1).reshape(n, h, d).to(q.dtype)
        return out

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
    ) -> Tensor:
        """q: [new_tokens, heads, head_dim] packed; cu_seqlens_q: [batch + 1]; context_lens: [batch].

        k, v: this step's new keys/values [new_tokens, kv_heads, head_dim] (already written to the
        cache); a sequence without a cached prefix attends to them directly.
        -> [new_tokens, heads, head_dim]
        """
        h = q.shape[1]
        kvh, _, bs, _ = k_cache.shape
        gqa = h != kvh
        out = torch.empty_like(q)
        starts = cu_seqlens_q.tolist()
        lens = context_lens.tolist()
        for i, n in enumerate(lens):
            s, e = starts[i], starts[i + 1]
            # 4-D inputs: CPU SDPA only takes its fused flash kernel for [batch, heads, len, dim].
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if e - s == n and k is not None and v is not None:
                ki = k[s:e].transpose(0, 1).unsqueeze(0).to(k_cache.dtype)  # [1, KVH, n, D]
                vi = v[s:e].transpose(0, 1).unsqueeze(0).to(v_cache.dtype)
                o = F.scaled_dot_product_attention(
                    qi.to(ki.dtype), ki, vi, is_causal=True, scale=scale, enable_gqa=gqa
                )
            else:
                nblk = -(-n // bs)
                blocks = block_tables[i, :nblk]
                ki = self._gather("k", k_cache, blocks, nblk * bs)[:, :, :n].transpose(0, 1)  # [1, KVH, n, D]
                vi = self._gather("v", v_cache, blocks, nblk * bs)[:, :, :n].transpose(0, 1)
                # query j sits at position n - q_len + j (causal over the cached prefix and itself)
                qpos = torch.arange(n - (e - s), n, device=q.device).unsqueeze(1)
                mask = torch.arange(n, device=q.device).unsqueeze(0) <= qpos
                o = F.scaled_dot_product_attention(
                    qi.to(ki.dtype), ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa
                )
            out[s:e] = o[0].transpose(0, 1).to(q.dtype)
        return out
