"""How a mixture-of-experts layer's experts are stored and computed (as linear_methods.py for linear layers):
the backend picks one method at load, and the experts' weights live in its layout from then on.

- TorchMoE: the torch reference (`experts_reference`), Hugging Face's loop over the experts any token
  picked, each expert's rows gathered and run through F.linear: every device, every dtype.
- PackedMoE: moe.c on the CPU under float32 activations, each expert packed as linear.c packs a layer
  (native_moe.py), float32 or bfloat16.
- TritonMoE: two grouped GEMMs over the rows sorted by expert on CUDA (triton_moe.py), wherever the
  backend runs Triton's attention.

Every method takes the experts as one `Experts` (experts.py: [E, 2I, H] gate_up, gate outputs first, then
up, and [E, H, I] down, in torch's layout before `store`; their biases and activation) and the router's
picks: ids [T, k] int64, weights [T, k] float32.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.kernels import native_moe
from worker.kernels.experts import ExpertActivation, Experts
from worker.kernels.native_linear import DEFAULT_TUNING, LinearTuning


def activate(gate_up: Tensor, inter: int, act: ExpertActivation) -> Tensor:
    # gate_up: [rows, 2I] -> [rows, I]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if act.kind == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def experts_reference(x: Tensor, ids: Tensor, weights: Tensor, experts: Experts) -> Tensor:
    """x: [T, H]; ids, weights: [T, k]; experts in torch's layout. -> [T, H] in x's dtype: each token's
    picks weighted and added in increasing expert order."""
    gate_up, down, act = experts.gate_up, experts.down, experts.activation
    gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias
    num_experts, k, inter = gate_up.shape[0], ids.shape[1], experts.inter
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, pick) slots grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    y = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tokens = slots // k
        gu = F.linear(x[tokens], gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        out = F.linear(activate(gu, inter, act), down[e], None if down_bias is None else down_bias[e])
        y.index_add_(0, tokens, (out * weights.reshape(-1)[slots, None]).to(y.dtype))
    return y


class MoEMethod(Protocol):
    name: str
    layout: str  # what `store` returns

    def takes(self, x_dtype: torch.dtype, weight: Tensor) -> bool:
        """Whether this method runs experts of this dtype and device under activations of x_dtype."""
        ...

    def store(self, w: Tensor) -> Tensor:
        """Experts [E, N, K] -> this method's layout."""
        ...

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        """store's inverse: -> [E, n, K]."""
        ...

    def apply(self, x: Tensor, ids: Tensor, weights: Tensor, experts: Experts) -> Tensor:
        """The experts' output [T, H] (experts_reference's), the weights in this method's layout."""
        ...


class TorchMoE:
    name, layout = "torch", "torch"

    def takes(self, x_dtype: torch.dtype, weight: Tensor) -> bool:
        return True

    def store(self, w: Tensor) -> Tensor:
        return w.contiguous()

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        return stored

    def apply(self, x: Tensor, ids: Tensor, weights: Tensor, experts: Experts) -> Tensor:
        return experts_reference(x, ids, weights, experts.weights_as(x.dtype))


class PackedMoE:
    name, layout = "c", "packed"

    def __init__(self, tuning: LinearTuning = DEFAULT_TUNING) -> None:
        self.tuning = tuning  # linear.c's, for every expert's products

    def takes(self, x_dtype: torch.dtype, weight: Tensor) -> bool:
        return (
            x_dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and native_moe.library() is not None
        )

    def store(self, w: Tensor) -> Tensor:
        return native_moe.pack_experts(w)

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        return native_moe.unpack_experts(stored, n)

    def apply(self, x: Tensor, ids: Tensor, weights: Tensor, experts: Experts) -> Tensor:
        return native_moe.experts(x, ids, weights, experts, tuning=self.tuning)


TORCH_MOE = TorchMoE()


class TritonMoE(TorchMoE):
    """triton_moe.py's grouped GEMMs on CUDA (imported at first use: Triton loads only where it runs); its
    experts are stored as the torch method stores them."""

    name, layout = "triton", "torch"

    def takes(self, x_dtype: torch.dtype, weight: Tensor) -> bool:
        return weight.device.type == "cuda"

    def apply(self, x: Tensor, ids: Tensor, weights: Tensor, experts: Experts) -> Tensor:
        from worker.kernels import triton_moe

        return triton_moe.moe_experts(x, ids, weights, experts.weights_as(x.dtype))
