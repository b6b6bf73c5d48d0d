"""Triton causal prefill attention over the paged cache (launcher: triton_attention.paged_prefill_attention).

Flash-attention tiling: a program owns one query tile of one sequence for one kv head, and streams key
tiles through an online softmax. A query tile holds BLOCK_Q tokens x GROUP query heads as BLOCK_M rows,
so each K/V tile feeds the whole GQA group. Sequences are packed without padding; to avoid a host sync
on cu_seqlens the grid is the upper bound total_tokens // BLOCK_Q + batch, and each program finds its
sequence by binary search over the tile offsets cu_seqlens[b] // BLOCK_Q + b (spare programs exit early).
A sliding window (WINDOWED): a tile's key loop starts at its first row's first visible key, so the tiles
before the window are never loaded. Soft-capping (SOFTCAP): triton_decode's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from worker.kernels.triton_decode import softcapped

# Finite running-max start: keeps fully masked rows free of NaN. A constexpr, as jit code may only
# read constexpr globals.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)  # a sink's logit in the scores' log2 units


@triton.jit
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    out_ptr,
    sinks_ptr,
    scale_log2,
    num_seqs,
    window,
    softcap_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # Largest b with cu_seqlens[b] // BLOCK_Q + b <= tile.
    lo = tile * 0  # int32 tensors from the start: loop-carried values must keep one type
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    b = lo
    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    t = tile - (q_start // BLOCK_Q + b)  # this program's tile index inside sequence b
    if t * BLOCK_Q < q_len:
        ctx = tl.load(context_lens_ptr + b)
        offs_r = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        tok = t * BLOCK_Q + offs_r // GROUP  # [BLOCK_M] token index inside the sequence
        head = kvh * GROUP + offs_r % GROUP
        r_mask = (offs_r < BLOCK_Q * GROUP) & (tok < q_len)
        row_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + row_off[:, None] + offs_d[None, :], mask=r_mask[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qpos = ctx - q_len + tok  # absolute position of each row's token
        # Keys past the tile's last query position are masked for every row: stop there.
        kv_end = ctx - q_len + tl.minimum((t + 1) * BLOCK_Q, q_len)
        kv_start = kv_end * 0  # an int32 tensor, as kv_end
        if WINDOWED:  # keys before the tile's first row's window are masked for every row: start there
            kv_start = tl.maximum(ctx - q_len + t * BLOCK_Q - window + 1, 0)

        m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        for n0 in range(kv_start, kv_end, BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < kv_end
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kvh * stride_ch
            kv_off = kv_off[:, None] + offs_d[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            if SOFTCAP:
                s = softcapped(s, softcap_log2)
            visible = n_mask[None, :] & (pos[None, :] <= qpos[:, None])
            if WINDOWED:
                visible = visible & (pos[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
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

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SINKS:  # gpt-oss: the sink joins the denominator, acc / (l + 2^(sink - m))
            sink = tl.load(sinks_ptr + head, mask=r_mask, other=0.0) * LOG2E
            # rows past the tile's tokens saw no key (m at NEG_BIG): their exponent is held at 0
            o = o * (l_i / (l_i + tl.exp2(tl.where(l_i > 0, sink - m_i, 0.0))))[:, None]
        o_off = (q_start + tok).to(tl.int64) * (HEADS * HEAD_DIM) + head * HEAD_DIM
        tl.store(
            out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None]
        )
