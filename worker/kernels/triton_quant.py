"""Triton GEMM over weights kept quantised on the GPU: y = x W^T (+ bias), W dequantised tile by tile in
registers, never in memory.

Weights (TritonLinear's layout, linear_methods.py):
- group-quantised, w = s * q - o per group of GROUP input rows and output: 4-bit q packed two to a byte
  along K ([N, K / 2] uint8, byte j holding k = 2j in its low nibble and 2j + 1 in its high one) or 8-bit
  q ([N, K] int8); table [N, K / GROUP, 2] float16 or float32 (s, o);
- FP8 E4M3 ([N, K] float8_e4m3fn) with a float32 scale per output.
Each program computes a [BLOCK_M, BLOCK_N] tile of y over K in BLOCK_K steps (BLOCK_K divides GROUP, so a
step reads one group's s and o); the dequantised [BLOCK_N, BLOCK_K] tile meets x in tl.dot in x's dtype,
accumulating in float32 (float32 x: exact float32 dots, not Triton's default TF32). On a machine without a
GPU the kernel runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 before this module is
imported), which is how the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from worker.kernels import triton_checks as checks

Q4, Q8, FP8 = 0, 1, 2  # the kernel's KIND
INVARIANT_BLOCK_M = 64  # the row tile under batch invariance, at every row count


@triton.jit
def quant_gemm_kernel(
    x_ptr,
    q_ptr,
    table_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP: tl.constexpr,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    groups = K // GROUP
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None],
            other=0.0,
        )
        rows = offs_n[:, None].to(tl.int64)
        if KIND == 0:  # 4-bit: BLOCK_K / 2 bytes a row, each two values
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(q_ptr + rows * (K // 2) + offs_b[None, :], mask=n_mask[:, None], other=0)
            q = tl.interleave(b & 0xF, b >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        elif KIND == 1:
            q = tl.load(q_ptr + rows * K + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
        else:
            q = tl.load(q_ptr + rows * K + offs_k[None, :], mask=n_mask[:, None], other=0)
        if KIND == 2 and FP8_BITS:  # E4M3 bits moved to float32's positions, times 2^120: the value
            u = q.to(tl.uint32)
            w = (((u & 0x7F) << 20) | ((u & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36
        elif KIND == 2:
            w = q.to(tl.float32)
        else:
            g = k0 // GROUP
            t = table_ptr + (offs_n.to(tl.int64) * groups + g) * 2
            s = tl.load(t, mask=n_mask, other=0.0).to(tl.float32)
            o = tl.load(t + 1, mask=n_mask, other=0.0).to(tl.float32)
            w = q * s[:, None] - o[:, None]
        acc += tl.dot(x, tl.trans(w).to(x.dtype), input_precision=DOT_PRECISION)
    if KIND == 2:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_off = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def interpreted() -> bool:
    """True when the kernel was built for the Triton interpreter (it then takes CPU tensors)."""
    return isinstance(quant_gemm_kernel, InterpretedFunction)


def _block_k(group: int, k: int) -> int:
    """The K step: at most 64, dividing the group (and K) so that one step reads one group's s and o."""
    step = 64
    while step > 16 and (group % step or k % step):
        step //= 2
    if group % step or k % step:
        raise ValueError(
            f"Triton quantised GEMM: groups of {group} rows in K = {k} need a step of 16 rows or more"
        )
    return step


def quant_linear(
    x: Tensor,
    q: Tensor,
    n: int,
    table: Tensor | None = None,
    group: int = 0,
    bits: int = 0,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    invariant: bool = False,
) -> Tensor:
    """y = x W^T (+ bias): x [M, K] (float16, bfloat16 or float32) -> [M, n] in x's dtype. Group-quantised
    W: q and table (with group, bits); FP8 W: q float8_e4m3fn [n, K] with scale [n] float32. invariant: one
    row tile at every M (batch invariance: the compiled kernel, and so a row's sums, must not follow the
    step's rows; BLOCK_K already follows only the group and K)."""
    m, k = x.shape
    x = x.contiguous()
    extra = [t for t in (table, scale, bias) if t is not None]
    checks.check_device(x, q, *extra, cpu_ok=interpreted())
    if bits:
        kind = Q4 if bits == 4 else Q8
        assert table is not None and table.shape == (n, k // group, 2)
        assert q.shape == ((n, k // 2) if bits == 4 else (n, k))
    else:
        kind, group = FP8, 64
        assert q.dtype == torch.float8_e4m3fn and scale is not None and q.shape == (n, k)
        if interpreted():  # the interpreter has no FP8 casts: the kernel widens the bits itself (a GPU's
            q = q.view(torch.uint8)  # own conversion keeps subnormals, which float32 math may flush)
    block_k = _block_k(group, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = INVARIANT_BLOCK_M if invariant else 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    dummy = q  # pointers a kernel variant does not read
    quant_gemm_kernel[grid](
        x, q, table if table is not None else dummy, scale if scale is not None else dummy,
        bias if bias is not None else dummy, y, m, n, k, x.stride(0), y.stride(0),
        GROUP=group, KIND=kind, HAS_BIAS=bias is not None, FP8_BITS=q.dtype == torch.uint8,
        DOT_PRECISION=checks.dot_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y


def pack_q4_rows(q: Tensor) -> Tensor:
    """4-bit q [N, K] (uint8 0..15) -> [N, K / 2] uint8, byte j = q[:, 2j] | q[:, 2j + 1] << 4."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_q4_rows(packed: Tensor) -> Tensor:
    """pack_q4_rows' inverse."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
