# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
# (Triton's DSL: @triton.jit is untyped and a kernel's parameter annotations mean something to Triton.)
"""Multi-LoRA on the GPU, Punica's BGMV: many adapters in one step, each token row with its own.

The layout and the contract are lora_ops.py's (its torch functions are the CPU path): a_stack [S, R, in],
b_stack [S, out, R] (B times the adapter's scaling), slots [T] with -1 for base-model rows, R the padded rank
shared by the slots. lora_shrink: s = x @ A[slot].T as [T, R] float32; lora_expand: y += s @ B[slot].T in
place, y + delta summed in float32 and rounded to y's dtype once. x, y and the weights may be float32,
bfloat16 or float16; every product and sum is float32.

Batch invariance is a product rule here: a row's result must never depend on the other rows of the step
(how many there are, which adapters they use). So each program computes one row (BGMV: the row gathers its
own slot's weights) and one tile of its outputs; nothing it does is sized by T:
- the grid is (T, output tiles), T never a kernel argument: the same compiled kernel for every T;
- a row's sums run over the reduction axis (in for the shrink, R for the expand) in steps of BLOCK_K (or
  BLOCK_R) chosen from that axis's length alone: column j of a [rows of outputs, BLOCK_K] float32
  accumulator takes the products k = j, j + BLOCK_K, ... in order, then one tl.sum across the columns, a
  reduction whose shape is fixed by the same constants; no split-K, no block size from T;
- the output tiles only decide which outputs a program writes, never how one is summed.
A row with slot -1 costs one load of its slot: the shrink writes it zeros, the expand leaves it untouched.
Grouping a slot's rows into row tiles (SGMV) would read each weight tile once per tile rather than once
per row, but only pays with tl.dot over the tile, whose per-row sums would then hang on the MMA's
treatment of a row's place in the tile (the interpreter cannot show it); here rows sharing an adapter
re-read its weights from L2 instead. A prefill of many rows on one adapter is where SGMV would win.

Slots are not range-checked (that would read them, a sync): they must lie in [-1, S). Without a GPU the
kernels run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 before this module is
imported), which is how the tests check them; there bfloat16 is rounded by hand (triton_invariant.rounded),
the interpreter's own conversion truncating.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from worker.kernels import triton_checks as checks
from worker.kernels.lora_ops import check_expand, check_shrink
from worker.kernels.triton_invariant import rounded

# Tiles: (outputs a program, reduction step). A [16, 256] float32 accumulator is 32 registers a thread
# across 4 warps, and 16 rank rows a program gives a one-row decode step R / 16 programs a layer rather than
# one. The reduction steps are the ones that set a row's bits: they follow in (or R) only.
SHRINK_BLOCK_R, SHRINK_BLOCK_K = 16, 256
EXPAND_BLOCK_N, EXPAND_BLOCK_R = 128, 64


@triton.jit
def shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, R, K, stride_xt, stride_as, stride_ar,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # One program per (row, BLOCK_R rank rows): out[t, r] = sum_k x[t, k] * a[slot, r, k].
    t = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        x_row = x_ptr + t * stride_xt
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r.to(tl.int64)[:, None] * stride_ar
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        # in from 0 up, BLOCK_K at a time; past in the loads are zeros, which add exactly nothing
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < K
            x = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc += x[None, :] * a.to(tl.float32)
        s = tl.sum(acc, axis=1)
    else:
        s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    tl.store(out_ptr + t * R + offs_r, s, mask=r_mask)


@triton.jit
def expand_kernel(
    y_ptr, s_ptr, b_ptr, slots_ptr, N, R, stride_yt, stride_st, stride_bs, stride_bn,
    BF16_BY_HAND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    # One program per (row, BLOCK_N outputs): y[t, n] = round(y[t, n] + sum_r s[t, r] * b[slot, n, r]).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:  # a base row: nothing read, nothing written
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < R
            s = tl.load(s_ptr + t * stride_st + r, mask=r_mask, other=0.0).to(tl.float32)
            b = tl.load(b_rows + r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
            acc += s[None, :] * b.to(tl.float32)
        y_at = y_ptr + t * stride_yt + offs_n
        y = tl.load(y_at, mask=n_mask, other=0.0).to(tl.float32) + tl.sum(acc, axis=1)
        tl.store(y_at, rounded(y, y_ptr.dtype.element_ty, BF16_BY_HAND), mask=n_mask)


def interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (they then take CPU tensors)."""
    return isinstance(shrink_kernel, InterpretedFunction)


def _step(length: int, cap: int) -> int:
    # a power of two covering length, at most cap: from the axis's length only
    return min(int(triton.next_power_of_2(max(length, 1))), cap)


def _rows(x: Tensor) -> Tensor:
    # unit stride along a row (the kernels step through it one element at a time); any row stride
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def lora_shrink(x: Tensor, a_stack: Tensor, slots: Tensor) -> Tensor:
    """x [T, in], a_stack [S, R, in] (x's dtype), slots [T] int32 (or int64) in [-1, S) -> [T, R] float32:
    row t is x[t] @ a_stack[slots[t]].T summed in float32, zeros where slots[t] == -1. Each row's result is
    bitwise the same whatever the other rows of the step."""
    check_shrink(x, a_stack, slots)
    checks.check_device(x, a_stack, slots, cpu_ok=interpreted())
    t, k = x.shape
    r = a_stack.shape[1]
    out = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if t and r:
        _launch_shrink(_rows(x), a_stack.contiguous(), slots.contiguous(), out, _step(k, SHRINK_BLOCK_K))
    return out


def _launch_shrink(x: Tensor, a_stack: Tensor, slots: Tensor, out: Tensor, block_k: int) -> None:
    # block_k is a parameter only so that the tests can show what another reduction step would do.
    t, k = x.shape
    r = a_stack.shape[1]
    block_r = _step(r, SHRINK_BLOCK_R)
    shrink_kernel[(t, triton.cdiv(r, block_r))](
        x, a_stack, slots, out, r, k, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip


def lora_expand(y: Tensor, s: Tensor, b_stack: Tensor, slots: Tensor) -> None:
    """In place: y[t] += s[t] @ b_stack[slots[t]].T for each row with a slot; y [T, out] with unit stride
    along out (a column slice of a fused output is fine), s [T, R] (float32 from lora_shrink, or any of
    the float dtypes), b_stack [S, out, R] (y's dtype), slots [T] int32 (or int64) in [-1, S). y + delta
    is summed in float32 and rounded to y's dtype once; rows of -1 are untouched, bit for bit. Each row's
    result is bitwise the same whatever the other rows of the step."""
    check_expand(y, s, b_stack, slots)
    checks.check_device(y, s, b_stack, slots, cpu_ok=interpreted())
    t, n = y.shape
    r = s.shape[1]
    if not (t and n and r):
        return
    _launch_expand(y, _rows(s), b_stack.contiguous(), slots.contiguous(), _step(r, EXPAND_BLOCK_R))


def _launch_expand(y: Tensor, s: Tensor, b_stack: Tensor, slots: Tensor, block_r: int) -> None:
    # block_r is a parameter only so that the tests can show what another reduction step would do.
    t, n = y.shape
    block_n = _step(n, EXPAND_BLOCK_N)
    expand_kernel[(t, triton.cdiv(n, block_n))](
        y, s, b_stack, slots, n, s.shape[1], y.stride(0), s.stride(0), b_stack.stride(0), b_stack.stride(1),
        BF16_BY_HAND=y.dtype == torch.bfloat16 and interpreted(), BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip


def lora_grouped(x: Tensor, y: Tensor, a_stack: Tensor, b_stack: Tensor, slots: Tensor) -> None:
    """Backend.lora_grouped: every row's adapter delta, B(A x), added to y in place (shrink, then expand)."""
    lora_expand(y, lora_shrink(x, a_stack, slots), b_stack, slots)
