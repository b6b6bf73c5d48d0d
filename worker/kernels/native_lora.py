"""Multi-LoRA in C (lora.c): every row's adapter delta added to a linear layer's float32 output in one call
over the step's rows, a row at a time in an order fixed by the shapes (batch-invariant by construction)."""

from __future__ import annotations

from ctypes import c_int, c_void_p
from types import SimpleNamespace

import torch
from torch import Tensor

from worker.kernels.native_build import KERNELS, Signature, cached, load

SOURCES = (KERNELS / "lora.c",)
SIGNATURES = {
    "batchq_lora": Signature(c_int, [c_void_p] + [c_int] * 4 + [c_void_p] * 3 + [c_int, c_void_p, c_int])
}


@cached
def library() -> SimpleNamespace | None:
    """The loaded LoRA kernel, or None (with one warning) where it cannot be built."""
    return load(SOURCES, "the LoRA adapters' grouped pass", SIGNATURES)


def lora_grouped(x: Tensor, y: Tensor, a_stack: Tensor, bt_stack: Tensor, slots: Tensor) -> None:
    """y [T, out] float32 += each row's B(A x): x [T, in], a_stack [S, R, in], bt_stack [S, R, out] (B
    transposed, scaled), slots [T] int32 (-1: no adapter), all float32 on the CPU."""
    lib = library()
    assert lib is not None
    assert x.dtype == y.dtype == a_stack.dtype == bt_stack.dtype == torch.float32 and y.is_contiguous()
    t, n_in = x.shape
    s, r, out = bt_stack.shape
    assert a_stack.shape == (s, r, n_in) and y.shape == (t, out) and slots.shape == (t,)
    x, slots = x.contiguous(), slots.to(torch.int32).contiguous()
    rc = lib.batchq_lora(
        x.data_ptr(), t, n_in, out, r, a_stack.contiguous().data_ptr(), bt_stack.contiguous().data_ptr(),
        slots.data_ptr(), s, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, f"lora.c refused [{t}, {n_in}] -> {out} over {s} slots of rank {r} (rc {rc})"
