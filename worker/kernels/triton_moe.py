"""A mixture-of-experts layer's experts on the GPU as two Triton grouped GEMMs over the rows sorted by expert.

The step's (token, pick) slots are sorted by expert on the device (`expert_blocks`: a stable argsort, each
expert's run padded to BLOCK_M rows, no host sync), so every block of BLOCK_M rows belongs to one expert.
`gate_up_kernel` computes a block's gate and up tiles against its expert's [2I, H] rows and applies the
activation in registers (silu(gate) * up, or gpt-oss's clamped SwiGLU), writing h [slots, I];
`down_kernel` multiplies h by the expert's [H, I] rows, adds its bias and scales each row by its routing
weight. A block reads only its own expert's weights, so each active expert's weights stream once per
(block of rows, column tile): once per step at decode sizes. The grid is sized for the worst case
(cdiv(slots, BLOCK_M) + experts blocks); blocks past the last expert's exit at once. Each token's picks are
then added in increasing expert order (experts_reference's order). Weights stay in torch's layout ([E, 2I,
H], [E, H, I]), in the compute dtype; tl.dot accumulates in float32 (exact float32 dots for a float32
model, not Triton's default TF32). Without a GPU the kernels run on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 before import), which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from worker.kernels import triton_checks as checks
from worker.kernels.experts import Experts

SILU, CLAMPED_SWIGLU = 0, 1  # the kernel's ACT
BLOCK_M = 16


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, b_ptr, h_ptr, slots_ptr, block_expert_ptr, H, INTER, TOPK, alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots >= 0
        tokens = tl.where(valid, slots // TOPK, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        gate_rows = (e.to(tl.int64) * 2 * INTER + offs_n)[:, None] * H
        up_rows = gate_rows + INTER * H
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            x = tl.load(x_ptr + tokens[:, None] * H + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
            wm = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(w_ptr + gate_rows + offs_k[None, :], mask=wm, other=0.0)
            wu = tl.load(w_ptr + up_rows + offs_k[None, :], mask=wm, other=0.0)
            acc_g += tl.dot(x, tl.trans(wg), input_precision=DOT_PRECISION)
            acc_u += tl.dot(x, tl.trans(wu), input_precision=DOT_PRECISION)
        if HAS_BIAS:
            base = e.to(tl.int64) * 2 * INTER
            acc_g += tl.load(b_ptr + base + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + base + INTER + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACT == 0:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        else:
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        out = tl.where(valid, slots, 0).to(tl.int64)[:, None] * INTER + offs_n[None, :]
        tl.store(h_ptr + out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def down_kernel(
    h_ptr, w_ptr, b_ptr, rw_ptr, out_ptr, slots_ptr, block_expert_ptr, H, INTER,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots >= 0
        rows = tl.where(valid, slots, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_rows = (e.to(tl.int64) * H + offs_n)[:, None] * INTER
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < INTER
            h = tl.load(h_ptr + rows[:, None] * INTER + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
            w = tl.load(w_ptr + w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(h, tl.trans(w), input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * H + offs_n, mask=n_mask, other=0.0).to(tl.float32)[
                None, :
            ]
        acc *= tl.load(rw_ptr + rows, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & n_mask[None, :])


def interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (they then take CPU tensors)."""
    return isinstance(gate_up_kernel, InterpretedFunction)


def expert_blocks(ids: Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[Tensor, Tensor]:
    """ids [T, k] -> slots [blocks * block_m] int32 (each block's (token, pick) slots, one expert's, -1 past
    its rows) and block_expert [blocks] int32 (-1: unused), blocks = cdiv(T * k, block_m) + experts. On the
    device, without a host sync."""
    flat = ids.reshape(-1)
    s = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    start = torch.cumsum(counts, 0) - counts
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    sorted_e = flat[order]
    pos = padded_start[sorted_e] + torch.arange(s, device=ids.device) - start[sorted_e]
    blocks = -(-s // block_m) + num_experts
    slots = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=ids.device)
    slots[pos] = order.to(torch.int32)
    first_rows = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, first_rows, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return slots, block_expert


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, experts: Experts) -> Tensor:
    """x: [T, H]; ids: [T, k] int64; weights: [T, k] float32; experts in torch's layout, gate_up and down in
    x's dtype. -> [T, H] in x's dtype (moe_methods.experts_reference's)."""
    gate_up_bias, down_bias, act = experts.gate_up_bias, experts.down_bias, experts.activation
    t, h = x.shape
    e, k, inter = experts.gate_up.shape[0], ids.shape[1], experts.inter
    x, gate_up, down = x.contiguous(), experts.gate_up.contiguous(), experts.down.contiguous()
    biases = [b for b in (gate_up_bias, down_bias) if b is not None]
    checks.check_device(x, ids, weights, gate_up, down, *biases, cpu_ok=interpreted())
    precision = checks.dot_precision(x.dtype)
    slots, block_expert = expert_blocks(ids, e)
    hidden = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    rw = weights.float().reshape(-1).contiguous()
    blocks = block_expert.numel()
    dummy = x
    block_n, block_k = 32, 32
    gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gate_up, gate_up_bias if gate_up_bias is not None else dummy, hidden, slots, block_expert, h, inter,
        k, act.alpha, act.limit, ACT=SILU if act.kind == "silu" else CLAMPED_SWIGLU,
        HAS_BIAS=gate_up_bias is not None, DOT_PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k,
    )  # fmt: skip
    down_kernel[(blocks, triton.cdiv(h, block_n))](
        hidden, down, down_bias if down_bias is not None else dummy, rw, out, slots, block_expert, h, inter,
        HAS_BIAS=down_bias is not None, DOT_PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k,
    )  # fmt: skip
    picks = out.view(t, k, h).gather(1, ids.argsort(dim=1)[:, :, None].expand(t, k, h))  # by expert
    y = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for j in range(k):
        y += picks[:, j]
    return y.to(x.dtype)
