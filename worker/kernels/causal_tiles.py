"""Causal attention of one sequence as tiles of batched matmuls (the torch backend's prefill in reduced
precision, and wherever a layer has a sliding window or soft-capping, which SDPA does not compute)."""

from __future__ import annotations

import torch
from torch import Tensor

TILE_ROWS = 128  # query positions per tile


def causal_tiles(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offset: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of one sequence, TILE_ROWS query positions at a time, as batched matmuls.

    q: [q_len, H, D] (packed rows); k, v: [KVH, n, D] (any strides with a unit last one); query j
    sits at position offset + j and sees keys 0..offset+j, the last `window` of them where a window is
    given (key positions count from k's first row). softcap: attention-logit soft-capping of the scaled
    scores (reference.py); sinks: [H] float32, a logit per head in every softmax's denominator (gpt-oss),
    or None. -> [q_len, H, D]

    Each tile reads only the keys its rows can see (from its first row's window start to its last row), so
    the causal half and what lies before the window are skipped, its scores stay in cache, and only the
    diagonal block (and the window's edge) needs a mask. The queries are laid out once per sequence as
    [KVH, q_len, G, D], so a tile's rows of one kv head are one contiguous matrix. Scores are scaled
    inside the matmul and rounded to q's dtype before the softmax (float32 inside). In bf16 this beats
    SDPA's flash kernel at prompt lengths of a few hundred tokens; in float32 SDPA is faster, so the
    caller keeps it there unless a window or a softcap asks for what SDPA does not compute.
    """
    q_len, h, d = q.shape
    kvh = k.shape[0]
    g = h // kvh
    qs = q.reshape(q_len, kvh, g, d).transpose(0, 1).contiguous()  # [KVH, q_len, G, D]
    kt = k.transpose(1, 2)  # [KVH, D, n]
    out = torch.empty(q_len, kvh, g, d, dtype=q.dtype, device=q.device)
    above = torch.ones(TILE_ROWS, TILE_ROWS, dtype=torch.bool, device=q.device).triu_(1)  # key > query
    unused = torch.zeros(1, 1, 1, dtype=q.dtype, device=q.device)  # baddbmm's input, times beta=0
    for a in range(0, q_len, TILE_ROWS):
        b = min(q_len, a + TILE_ROWS)
        rows, end = b - a, offset + b  # keys up to end - 1: what the tile's last row sees
        start = 0 if window is None else max(0, offset + a - window + 1)  # its first row's first key
        qt = qs[:, a:b].reshape(kvh, rows * g, d)  # a view: rows of one kv head are contiguous
        scores = torch.baddbmm(unused, qt, kt[:, :, start:end], beta=0, alpha=scale)  # [KVH, rows*G, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        by_row = scores.view(kvh, rows, g, end - start)
        if window is None:
            by_row[..., end - rows :].masked_fill_(above[:rows, None, :rows], float("-inf"))
        else:
            qpos = torch.arange(offset + a, end, device=q.device).view(rows, 1, 1)
            kpos = torch.arange(start, end, device=q.device).view(1, 1, -1)
            by_row.masked_fill_((kpos > qpos) | (kpos <= qpos - window), float("-inf"))
        probs = torch.softmax(scores, dim=-1) if sinks is None else with_sinks(scores, sinks, rows, g)
        out[a:b] = torch.bmm(probs, v[:, start:end]).view(kvh, rows, g, d).transpose(0, 1)
    return out.view(q_len, h, d)


def first_block(earliest_query: int, window: int | None, block_size: int) -> int:
    """The first cache block a sequence's queries read, the earliest at position earliest_query: the blocks
    before it hold only keys before every query's window (the engine may have released them)."""
    return 0 if window is None else max(0, earliest_query - window + 1) // block_size


def with_sinks(scores: Tensor, sinks: Tensor, rows: int, g: int) -> Tensor:
    """softmax over each row's scores and its head's sink, the sink's own share dropped (gpt-oss).
    scores: [KVH, rows * G, keys] (query rows of one kv head, G heads each); sinks: [KVH * G]."""
    kvh = scores.shape[0]
    sink = sinks.to(scores.dtype).view(kvh, 1, g, 1).expand(kvh, rows, g, 1).reshape(kvh, rows * g, 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
