"""A mixture-of-experts MLP's experts in C (moe.c, over linear.c's products) and their packed layout: each
expert's gate_up [2I, H] and down [H, I] weights packed as linear.c packs a linear layer's, the experts one
after another, so every expert's weights stream once per step over all the rows routed to it."""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_void_p
from types import SimpleNamespace

import torch
from torch import Tensor

from worker.kernels import native_linear
from worker.kernels.experts import Experts
from worker.kernels.native_build import KERNELS, Signature, cached, load
from worker.kernels.native_linear import DEFAULT_TUNING, LinearTuning

SOURCES = (KERNELS / "moe.c", *native_linear.SOURCES)
SIGNATURES = {
    "batchq_moe": Signature(
        c_int,
        [c_void_p] + [c_int] * 5 + [c_void_p] * 6 + [c_int] * 2 + [c_float] * 2 + [c_void_p, c_int, c_void_p],
    ),
}
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # moe.c's `act`
MAX_TOP_K = 64  # moe.c's picks per token


@cached
def library() -> SimpleNamespace | None:
    """The loaded MoE kernel (moe.c with linear.c), or None (with one warning) where it cannot be built."""
    return load(SOURCES, "the mixture-of-experts layers", SIGNATURES)


def pack_experts(w: Tensor) -> Tensor:
    """Experts' weights [E, N, K] -> [E, ceil(N / PANEL), K, PANEL] (linear.c's layout per expert)."""
    return torch.stack([native_linear.pack(e) for e in w]).contiguous()


def unpack_experts(packed: Tensor, n: int) -> Tensor:
    """pack_experts' inverse: -> [E, n, K]."""
    return torch.stack([native_linear.unpack(e, n) for e in packed])


def experts(
    x: Tensor, ids: Tensor, weights: Tensor, experts: Experts, tuning: LinearTuning = DEFAULT_TUNING
) -> Tensor:
    """x: [T, H] float32; ids: [T, k] int64; weights: [T, k] float32; experts' gate_up [E, panels, H, PANEL]
    and down [E, panels, I, PANEL] (pack_experts, float32 or bfloat16), biases [E, 2I], [E, H] float32 or
    None; tuning: linear.c's (the backend's). -> [T, H] float32 (moe.c says how)."""
    lib = library()
    assert lib is not None
    gate_up, down = experts.gate_up, experts.down
    gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias
    activation, alpha, limit = experts.activation
    t, h = x.shape
    e, k, inter = gate_up.shape[0], ids.shape[1], experts.inter
    assert gate_up.dtype == down.dtype and gate_up.dtype in (torch.float32, torch.bfloat16)
    assert down.shape[0] == e and gate_up.shape[2] == h and k <= MAX_TOP_K
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.float().contiguous()
    out = torch.empty(t, h, dtype=torch.float32)
    rc = lib.batchq_moe(
        x.data_ptr(), t, h, inter, e, k, ids.data_ptr(), weights.data_ptr(), gate_up.data_ptr(),
        down.data_ptr(), None if gate_up_bias is None else gate_up_bias.data_ptr(),
        None if down_bias is None else down_bias.data_ptr(), native_linear.WEIGHT_TYPES[gate_up.dtype],
        ACTIVATIONS[activation], alpha, limit, out.data_ptr(), torch.get_num_threads(), ctypes.byref(tuning),
    )  # fmt: skip
    assert rc == 0, f"moe.c refused [{t}, {h}] x {e} experts of {inter} (an expert id out of range?)"
    return out
