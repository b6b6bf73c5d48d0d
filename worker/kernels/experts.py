"""A mixture-of-experts layer's experts as every experts kernel takes them (moe_methods.py's methods, the torch
reference, native_moe.py, triton_moe.py): their weights, biases and activation, one value beside the step's
tokens. Its own module so that the kernels can take it without importing the methods that choose them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class ExpertActivation(NamedTuple):
    """silu: silu(gate) * up; clamped_swiglu (gpt-oss): gate clamped above at `limit`, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""

    kind: str
    alpha: float = 0.0
    limit: float = 0.0


class Experts(NamedTuple):
    """gate_up: each expert's gate rows, then its up rows; down: each expert's down rows. In torch's layout
    [E, 2I, H] and [E, H, I], or as a method stores them (native_moe.pack_experts: [E, panels, H, PANEL] and
    [E, panels, I, PANEL]). Biases [E, 2I] and [E, H], or None."""

    gate_up: Tensor
    down: Tensor
    activation: ExpertActivation
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None

    @property
    def inter(self) -> int:
        """I, each expert's intermediate size: down's third dimension in either layout."""
        return self.down.shape[2]

    def weights_as(self, dtype: torch.dtype) -> Experts:
        """gate_up and down as `dtype`; the biases as they are."""
        return self._replace(gate_up=self.gate_up.to(dtype), down=self.down.to(dtype))
