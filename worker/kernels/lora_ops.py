"""Multi-LoRA in torch: the CPU engine's path, and the input checks the Triton kernels (triton_lora.py) share.

A linear layer holds, for S resident adapter slots, stacked LoRA weights of one padded rank R (zeros past an
adapter's own rank, which add exactly nothing):
- a_stack [S, R, in]: the shrink weights (LoRA A);
- b_stack [S, out, R]: the expand weights (LoRA B, already times the adapter's scaling);
- slots [T] int32 (or int64): each token row's slot, -1 for a row of the base model.
lora_shrink: s[t] = x[t] @ a_stack[slots[t]].T in float32 ([T, R] float32; zeros for -1);
lora_expand: y[t] += s[t] @ b_stack[slots[t]].T in place, the sum taken in float32 and rounded to y's dtype
once; rows of -1 untouched.

Here each distinct slot of the step is one group: its rows gathered, one torch.matmul, the results
written back to those rows. A row's result thus never depends on the rows of other slots, nor on the base
rows. It may depend on how many rows share its slot: torch's CPU GEMMs (oneDNN, MKL, OpenBLAS) pick their
kernel and blocking by row count (a GEMV for one row), which can change the order of a row's sums; the
engine can make that invariant later (a fixed-order kernel, as the C linear layers are). The Triton path
has no such caveat.
"""

from __future__ import annotations

import torch
from torch import Tensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_slots(slots: Tensor, t: int) -> None:
    if slots.dim() != 1 or slots.shape[0] != t:
        raise ValueError(f"slots must be [{t}] (a slot per row), got {tuple(slots.shape)}")
    if slots.dtype not in INDEX_DTYPES:
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")


def _check_float(name: str, x: Tensor) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} dtype must be one of {DTYPES}, got {x.dtype}")


def check_shrink(x: Tensor, a_stack: Tensor, slots: Tensor) -> None:
    """ValueError unless x [T, in], a_stack [S, R, in] of x's dtype, slots [T] (metadata only: no sync)."""
    _check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, in], got {tuple(x.shape)}")
    if a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"a_stack must be [S, R, {x.shape[1]}] (x's in), got {tuple(a_stack.shape)}")
    if a_stack.dtype != x.dtype:
        raise ValueError(f"a_stack dtype {a_stack.dtype} must match x's {x.dtype}")
    _check_slots(slots, x.shape[0])


def check_expand(y: Tensor, s: Tensor, b_stack: Tensor, slots: Tensor) -> None:
    """ValueError unless y [T, out], s [T, R], b_stack [S, out, R] of y's dtype, slots [T]; y is written in
    place, so its rows must have unit stride (a column slice of a wider output is fine)."""
    _check_float("y", y)
    _check_float("s", s)
    if y.dim() != 2 or s.dim() != 2 or s.shape[0] != y.shape[0]:
        raise ValueError(f"y must be [T, out] and s [T, R], got {tuple(y.shape)} and {tuple(s.shape)}")
    want = (y.shape[1], s.shape[1])
    if b_stack.dim() != 3 or tuple(b_stack.shape[1:]) != want:
        raise ValueError(
            f"b_stack must be [S, {want[0]}, {want[1]}] (y's out, s's R), got {tuple(b_stack.shape)}"
        )
    if b_stack.dtype != y.dtype:
        raise ValueError(f"b_stack dtype {b_stack.dtype} must match y's {y.dtype}")
    if y.shape[1] > 1 and y.stride(1) != 1:
        raise ValueError(
            f"y must have unit stride along out (it is written in place), got strides {y.stride()}"
        )
    _check_slots(slots, y.shape[0])


def slot_groups(slots: Tensor, num_slots: int) -> list[tuple[int, Tensor]]:
    """(slot, its rows in increasing order) for each distinct slot >= 0 in slots, by slot. ValueError for a
    slot outside [-1, num_slots). Reads slots' values: on a GPU, a sync."""
    found = torch.unique(slots).tolist()
    bad = [s for s in found if not -1 <= s < num_slots]
    if bad:
        raise ValueError(f"slots must lie in [-1, {num_slots}), got {bad}")
    return [(s, (slots == s).nonzero().squeeze(1)) for s in found if s >= 0]


def lora_shrink_torch(x: Tensor, a_stack: Tensor, slots: Tensor) -> Tensor:
    """x [T, in], a_stack [S, R, in], slots [T] -> [T, R] float32: row t is x[t] @ a_stack[slots[t]].T,
    summed in float32 (16-bit operands widened first: a 16-bit matmul would round the result); zeros where
    slots[t] == -1."""
    check_shrink(x, a_stack, slots)
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in slot_groups(slots, a_stack.shape[0]):
        out.index_copy_(0, rows, torch.matmul(x[rows].float(), a_stack[slot].float().t()))
    return out


def lora_expand_torch(y: Tensor, s: Tensor, b_stack: Tensor, slots: Tensor) -> None:
    """In place: y[t] += s[t] @ b_stack[slots[t]].T for every row with a slot, y [T, out], s [T, R] (any
    float dtype, float32 from lora_shrink_torch), b_stack [S, out, R]; rows of -1 untouched, bit for bit.
    The sum y + delta is taken in float32 and rounded to y's dtype once (index_add_ of a delta in y's dtype
    would round twice)."""
    check_expand(y, s, b_stack, slots)
    for slot, rows in slot_groups(slots, b_stack.shape[0]):
        delta = torch.matmul(s[rows].float(), b_stack[slot].float().t())
        y.index_copy_(0, rows, (y[rows].float() + delta).to(y.dtype))


def lora_grouped_torch(x: Tensor, y: Tensor, a_stack: Tensor, b_stack: Tensor, slots: Tensor) -> None:
    """Backend.lora_grouped on torch's ops (backends with neither lora.c nor Triton): every row's B(A x)
    added to y in place, each slot's rows through two matmuls."""
    lora_expand_torch(y, lora_shrink_torch(x, a_stack, slots), b_stack, slots)
