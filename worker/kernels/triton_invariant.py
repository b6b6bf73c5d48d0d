"""Batch-invariant Triton kernels: a row's numbers never depend on the rows beside it (issue 51).

A request's logits must be bitwise the same whatever else shares its step. cuBLAS picks its GEMM by row
count, torch's reductions split a row across thread blocks when there are few rows, and split-K attention
sizes its splits from the batch; each changes the order in which a row's sums are taken, and so its bits.
The kernels here fix that order per row, whatever the batch:

- matmul: y = x W^T (+ b), tiles, K step, warps and stages constants (never chosen from M, no split-K), K
  summed from 0 up in BLOCK_K steps, the tail last, by the same compiled kernel for every M;
- rmsnorm: one program per row holding the whole row, its launch parameters chosen from D only;
- decode_merge_kernel: the merge of paged decode attention's splits when their size is fixed
  (triton_attention.paged_decode_attention's split_tokens): each sequence sums its own splits one by one,
  in order, so neither the number of splits the batch needs nor its padding reach a sequence's sum.

On a machine without a GPU the kernels run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1
before this module is imported), which is how the tests check them; matmul's tile product is then a
broadcast sum rather than tl.dot (numpy's BLAS behind the interpreter's tl.dot is not row-invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from worker.kernels import triton_checks as checks

# GEMM tiles for an H100 / H200 in bfloat16. 128 x 128 outputs a program with 8 warps (two warpgroups, each
# a 64-row wgmma) is the shape these GPUs' tensor cores run near peak; K steps of 64 (128 bytes of bf16 a
# row, one swizzled shared-memory line) and 3 stages in flight take (128 + 128) x 64 x 2 B x 3 = 96 KiB of
# the 228 KiB of shared memory, enough to hide HBM latency behind the MMAs. A decode step (M <= 128) then
# fills one row tile and streams each weight tile once; its padding rows are free, the step being
# memory-bound. None of these may follow M: a different tile or instruction shape sums a row's K in a
# different order.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
GEMM_WARPS, GEMM_STAGES = 8, 3
BAND_M = 8  # row tiles per band of the launch order (L2 reuse of weight tiles; no effect on any sum)

MAX_NORM_DIM = 16384  # a row held whole in one program's registers
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# a sink's logit in the scores' log2 units (a constexpr: jit code may read no other globals)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def rounded(y, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """float32 y rounded to DTYPE, to nearest even. BF16_BY_HAND: the interpreter truncates float32 to
    bfloat16 (whatever the rounding asked): there the bits are rounded first, so that its truncation lands
    on the nearest value, as a GPU's conversion does."""
    if BF16_BY_HAND:
        u = y.to(tl.uint32, bitcast=True)
        y = (u + 0x7FFF + ((u >> 16) & 1)).to(tl.float32, bitcast=True)
    return y.to(DTYPE)


# M is never specialised (Triton would compile a separate kernel for M == 1): one kernel for every M.
@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BROADCAST_DOT: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BAND_M: tl.constexpr,
):
    # Launch order: bands of BAND_M row tiles; within a band, the row tiles of one column tile run together,
    # so each weight tile is read from HBM about once per band rather than once per row tile.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (BAND_M * tiles_n)
    band_rows = tl.minimum(tiles_m - band * BAND_M, BAND_M)
    in_band = pid - band * BAND_M * tiles_n
    pid_m = band * BAND_M + in_band % band_rows
    pid_n = in_band // band_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]: W^T's columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K from 0 up, one BLOCK_K step at a time; the last step's missing K are zeros (x * 0 adds exactly 0).
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BROADCAST_DOT:
            # The interpreter's tl.dot is numpy's BLAS, whose sums differ by a row's place in the block
            # (OpenBLAS's AVX-512 sgemm does), and misreads bfloat16: there a float32 broadcast product
            # summed along K, in K order for every row. A GPU's MMA sums every row of a tile alike.
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y = rounded(acc, y_ptr.dtype.element_ty, BF16_BY_HAND)
    tl.store(y_ptr + y_off, y, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def rmsnorm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    D,
    stride_xt,
    eps,
    offset,
    PLUS_OFFSET: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per row, the whole row in one block: its sum of squares is one reduction whose shape
    # (BLOCK_D, the warps) follows D alone.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xn = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dtype = y_ptr.dtype.element_ty
    if PLUS_OFFSET:  # Gemma: (w + offset) and the product in float32, one rounding at the end
        y = xn * (w + offset)
    else:  # Llama: the normalised row rounded to x's dtype, then times w (a product of 16-bit values is
        y = rounded(xn, dtype, BF16_BY_HAND).to(tl.float32) * w  # exact in float32: rounded once, as torch)
    tl.store(y_ptr + t * D + offs, rounded(y, dtype, BF16_BY_HAND), mask=mask)


@triton.jit
def decode_merge_kernel(
    part_o_ptr,
    part_ml_ptr,
    context_lens_ptr,
    out_ptr,
    sinks_ptr,
    split_tokens,
    num_splits,
    window,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
):
    # One program per (sequence, query head). part_o: [batch, heads, num_splits, HEAD_DIM] (each split's
    # normalised output), part_ml: [batch, heads, num_splits, 2] (its max and sum), as triton_decode's
    # decode_kernel writes them. Only the sequence's own splits are read, cdiv(its keys, split_tokens), all
    # non-empty, and summed in order: the batch's num_splits only spaces the rows.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    if WINDOWED:
        ctx = tl.minimum(ctx, window)
    own = tl.cdiv(ctx, split_tokens)
    row0 = (b * HEADS + h) * num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    m_max = tl.load(part_ml_ptr + row0 * 2)
    for s in range(1, own):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (row0 + s) * 2))
    denom = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in range(0, own):
        m = tl.load(part_ml_ptr + (row0 + s) * 2)
        w = tl.load(part_ml_ptr + (row0 + s) * 2 + 1) * tl.exp2(m - m_max)
        denom += w
        acc += tl.load(part_o_ptr + (row0 + s) * HEAD_DIM + offs_d) * w
    if SINKS:  # the sink's share of the denominator, at the splits' common max
        denom += tl.exp2(tl.load(sinks_ptr + h) * LOG2E - m_max)
    tl.store(out_ptr + (b * HEADS + h) * HEAD_DIM + offs_d, (acc / denom).to(out_ptr.dtype.element_ty))


def interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (they then take CPU tensors)."""
    return isinstance(matmul_kernel, InterpretedFunction)


def _bf16_by_hand(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreted()


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x W^T (+ bias), F.linear's contract: x [..., K], weight [N, K], bias [N] or None, all of one dtype
    (float16, bfloat16 or float32; float32 accumulation, exact float32 dots for float32) -> [..., N] in x's
    dtype, contiguous. Any strides. Each row's result is bitwise the same for any number of rows and any
    place among them."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype must be one of {DTYPES}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must be [..., K], got a 0-D tensor")
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}] (x's last dim), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match x's {x.dtype}")
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be [{n}] {x.dtype} (weight's rows, x's dtype), got {tuple(bias.shape)} {bias.dtype}"
        )
    checks.check_device(x, weight, *([bias] if bias is not None else []), cpu_ok=interpreted())
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        _launch_matmul(x2, weight, bias, y, BLOCK_M, BLOCK_N, BLOCK_K)
    return y.view(*lead, n)


def _launch_matmul(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    y: Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    broadcast_dot: bool | None = None,
) -> None:
    # The tiles are parameters here only so that the tests can show what tiles chosen by M would do, and
    # broadcast_dot (default: under the interpreter) so that they can run tl.dot's path there too.
    if broadcast_dot is None:
        broadcast_dot = interpreted()
    m, k = x.shape
    n = weight.shape[0]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, BROADCAST_DOT=broadcast_dot, BF16_BY_HAND=_bf16_by_hand(x.dtype),
        DOT_PRECISION=checks.dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BAND_M=BAND_M,
        num_warps=GEMM_WARPS, num_stages=GEMM_STAGES,
    )  # fmt: skip


def rmsnorm(x: Tensor, weight: Tensor, eps: float, *, offset: float = 0.0) -> Tensor:
    """RMSNorm as layers.RMSNorm computes it: x [..., D] (float16, bfloat16 or float32), weight [D] (any
    float dtype) -> [..., D] in x's dtype, contiguous.

    offset == 0 (Llama): w * (x / rms(x)) rounded to x's dtype first (torch's `weight * xf.to(dtype)`,
    exact for a weight of x's dtype, as the model's are). offset != 0 (Gemma's 1 + w: offset=1.0):
    x / rms(x) * (w + offset), all in float32, rounded once. rms in float32: sqrt(mean(x^2) + eps).
    Each row's result is bitwise the same for any number of rows and any place among them."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype must be one of {DTYPES}, got {x.dtype}")
    if x.dim() < 1 or not 1 <= x.shape[-1] <= MAX_NORM_DIM:
        raise ValueError(f"x must be [..., D] with 1 <= D <= {MAX_NORM_DIM}, got {tuple(x.shape)}")
    d = x.shape[-1]
    if weight.shape != (d,) or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a float [{d}] (x's last dim), got {tuple(weight.shape)} {weight.dtype}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    checks.check_device(x, weight, cpu_ok=interpreted())
    x2 = x.reshape(-1, d)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block_d = triton.next_power_of_2(d)
        rmsnorm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), y, d, x2.stride(0), float(eps), float(offset),
            PLUS_OFFSET=offset != 0, BF16_BY_HAND=_bf16_by_hand(x.dtype), BLOCK_D=block_d,
            num_warps=4 if block_d <= 2048 else 8 if block_d <= 8192 else 16,
        )  # fmt: skip
    return y.view(x.shape)
