"""The dense gated MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from worker.models.layers import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)
