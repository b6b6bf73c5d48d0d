"""Triton paged decode attention (launcher: triton_attention.paged_decode_attention).

One program per (sequence, kv head, context split) handles all query heads of the GQA group at once,
so each K/V tile is read from HBM once per group rather than once per query head. The group is padded
to BLOCK_H >= 16 rows because tl.dot needs at least 16 rows; decode is memory-bound, the padding is free.
Split-K: with few sequences the context is cut into NUM_SPLITS chunks processed by separate programs;
a second kernel merges their partial results by their softmax statistics.
A sliding window (WINDOWED): the splits cover the last `window` tokens of each context only, so no tile
before it is loaded. Soft-capping (SOFTCAP): scores = softcap * tanh(scores / softcap) before the mask.
Attention sinks (SINKS, gpt-oss): a logit per head added to the softmax's denominator, at the end (or in
the merge), where the row's max and sum are known.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite "minus infinity" for the running max: exp2(-inf - -inf) would be NaN for an empty split.
NEG_BIG = tl.constexpr(-1.0e30)  # jit code may only read constexpr globals
LOG2E = tl.constexpr(1.4426950408889634)  # a sink's logit in the scores' log2 units


@triton.jit
def softcapped(s, cap):
    """cap * tanh(s / cap), with tanh from one exp of a non-positive argument (no overflow; no libdevice,
    which the interpreter lacks). The scores are in log2 units here, and so is cap: the cap of natural-log
    scores times log2(e) caps their log2 image."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x >= 0, t, -t)


@triton.jit
def decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    sinks_ptr,
    scale_log2,
    tokens_per_split,
    window,
    softcap_log2,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start = split * tokens_per_split
    if WINDOWED:  # the splits tile the window: the first key the query sees, on
        start += tl.maximum(ctx - window, 0)
    end = tl.minimum(ctx, start + tokens_per_split)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    head = kvh * GROUP + offs_h
    # q: [BLOCK_H, HEAD_DIM], padding rows are zeros (their results are never stored).
    q_off = b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=h_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        # Per-token physical block lookup lets a tile span several cache blocks (BLOCK_N >= block size).
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        kv_off = kv_off[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        if SOFTCAP:
            s = softcapped(s, softcap_log2)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        p = p.to(v.dtype)  # 16-bit P for the tensor cores, as flash attention does
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (start >= ctx) has l_i == 0; it contributes nothing to the merge.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        if SINKS:  # the sink joins the denominator: acc / (l + 2^(sink - m))
            sink = tl.load(sinks_ptr + head, mask=h_mask, other=0.0) * LOG2E
            o = o * (l_i / (l_i + tl.exp2(sink - m_i)))[:, None]
        o_off = b.to(tl.int64) * (HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        # part_o: [batch, heads, NUM_SPLITS, HEAD_DIM]; part_ml: [batch, heads, NUM_SPLITS, 2] (max, sum).
        row = (b.to(tl.int64) * HEADS + head) * NUM_SPLITS + split
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=h_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_mask)


@triton.jit
def decode_merge_kernel(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    sinks_ptr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    # One program per (sequence, query head): softmax-weighted sum of the split results.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    row = (b * HEADS + h) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=NEG_BIG)
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = l_s * tl.exp2(m - m_max)  # [SPLITS_PAD]
    denom = tl.sum(w, 0)
    if SINKS:  # the sink's share of the denominator, at the splits' common max
        denom += tl.exp2(tl.load(sinks_ptr + h) * LOG2E - m_max)
    res = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + (b * HEADS + h) * HEAD_DIM + offs_d, res.to(out_ptr.dtype.element_ty))
