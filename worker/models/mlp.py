"""The dense gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one projection; act SiLU, or
Gemma's GELU (spec.ACTIVATIONS)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.models.layers import Linear

if TYPE_CHECKING:
    from worker.parallel.group import TPGroup

# spec.ACTIVATIONS, as transformers' ACT2FN computes each: SiLU, GELU's tanh approximation (Gemma's
# gelu_pytorch_tanh), exact GELU
ACT: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, activation: str = "silu") -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.act = ACT[activation]
        self.activation = activation
        # act(gate) * up in one C pass (the backend's, at load: float32 on the CPU), the decode stack's
        # activation, so a token's MLP computes the same in a decode step as in a mixed one
        self.c_act_mul: Callable[[Tensor, int, str], Tensor] | None = None
        self.tp: TPGroup | None = (
            None  # tensor parallelism: down_proj's partial outputs summed over the ranks
        )

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)
        if self.c_act_mul is not None and gate_up.dtype == torch.float32 and gate_up.dim() == 2:
            out = self.down_proj(self.c_act_mul(gate_up, self.inter, self.activation))
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)
