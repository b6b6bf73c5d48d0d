"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): the router's top-k picks per token, as
its family routes (spec.MoESpec), and the experts computed grouped by the backend's method (moe_methods.py:
each active expert's weights read once per step over all its rows).

Experts are held as two parameters, [E * 2I, hidden] gate_up (each expert's gate rows, then its up rows)
and [E * hidden, I] down, which the checkpoint's per-expert tensors fill row range by row range (Mixtral's
w1 / w3 / w2, Qwen's gate_proj / up_proj / down_proj); gpt-oss's fused [E, hidden, 2I] tensor, its gate
and up interleaved, is transposed and de-interleaved into the same layout as it loads (`gpt_oss_layout`).
`use_method` moves them into the method's layout (linear.c's panels for moe.c). Tokens per expert are
counted on the device, one bincount per forward (`counts`), read when the engine's stats are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from worker.kernels.backend import TORCH_MOE, ExpertActivation, Experts, MoEMethod
from worker.models.layers import Linear
from worker.models.mlp import MLP
from worker.models.sharding import Shard
from worker.models.spec import DecoderSpec, MoESpec
from worker.models.weights import Slot

if TYPE_CHECKING:
    from worker.parallel.group import TPGroup


class MoE(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.moe, self.kind, self.hidden = moe, moe.kind, spec.hidden_size
        e, h, i = moe.num_experts, spec.hidden_size, moe.intermediate_size
        self.gate = Linear(h, e, bias=moe.router_bias)  # the router
        self.gate_up = nn.Parameter(torch.empty(e * 2 * i, h))  # in self.method's layout after use_method
        self.down = nn.Parameter(torch.empty(e * h, i))
        self.gate_up_bias = nn.Parameter(torch.empty(e * 2 * i)) if moe.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e * h)) if moe.expert_bias else None
        self.shared_expert = (
            None if moe.shared_intermediate is None else MLP(h, moe.shared_intermediate, False)
        )
        self.shared_expert_gate = None if moe.shared_intermediate is None else Linear(h, 1, bias=False)
        self.act = ExpertActivation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
        self.method: MoEMethod = TORCH_MOE
        self.counts: Tensor | None = None  # [E] int64: tokens routed to each expert (None: none yet)
        # tensor parallelism: the group, and the checkpoint's MoESpec (moe is then this rank's: each expert's
        # share of the intermediate rows); the experts' partial outputs are summed over the ranks
        self.tp: TPGroup | None = None
        self.full_moe = moe

    @torch.no_grad()
    def use_method(self, method: MoEMethod) -> None:
        """Run `method`, the experts moved into its layout (the backend's choice, made once at load)."""
        if method.layout != self.method.layout:
            gate_up, down = self.experts()
            self.gate_up = nn.Parameter(method.store(gate_up), requires_grad=False)
            self.down = nn.Parameter(method.store(down), requires_grad=False)
        self.method = method

    @torch.no_grad()
    def store_experts(self, dtype: torch.dtype) -> None:
        """Keep the experts' weights as `dtype` (weight_dtype bfloat16), before use_method."""
        assert self.method.layout == "torch"
        self.gate_up = nn.Parameter(self.gate_up.to(dtype), requires_grad=False)
        self.down = nn.Parameter(self.down.to(dtype), requires_grad=False)

    def experts(self) -> tuple[Tensor, Tensor]:
        """gate_up [E, 2I, hidden] and down [E, hidden, I], whatever the layout."""
        e, i = self.moe.num_experts, self.moe.intermediate_size
        if self.method.layout == "torch":
            return self.gate_up.view(e, 2 * i, self.hidden), self.down.view(e, self.hidden, i)
        return self.method.unpack(self.gate_up, 2 * i), self.method.unpack(self.down, self.hidden)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [T, hidden] -> the experts each token picks, ids [T, k] int64, and their weights [T, k]
        float32, as the family's router computes them."""
        logits = self.gate(x)
        k = self.moe.top_k
        if self.moe.routing == "topk_softmax":  # gpt-oss: the top-k logits, then a softmax over them
            top, ids = torch.topk(logits, k, dim=-1)
            return ids, torch.softmax(top.float(), dim=-1)
        probs = torch.softmax(logits.float(), dim=-1)
        top, ids = torch.topk(probs, k, dim=-1)
        if self.moe.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        ids, weights = self.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=self.moe.num_experts)
        self.counts = counts if self.counts is None else self.counts + counts
        gate_up, down = self.experts() if self.method.layout == "torch" else (self.gate_up, self.down)
        e = self.moe.num_experts
        gu_bias = None if self.gate_up_bias is None else self.gate_up_bias.view(e, -1)
        d_bias = None if self.down_bias is None else self.down_bias.view(e, -1)
        y = self.method.apply(x, ids, weights, Experts(gate_up, down, self.act, gu_bias, d_bias))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y if self.tp is None else self.tp.all_reduce(y)

    def own_parameters(self) -> list[nn.Parameter]:
        """The parameters `slots` names (the shared expert's load under their own names)."""
        own = [self.gate_up, self.down, *self.gate.parameters()]
        return own + [b for b in (self.gate_up_bias, self.down_bias) if b is not None]

    def slots(self, ours: str, layer: int) -> dict[str, Slot]:
        """Hugging Face's names of the router's and the experts' tensors -> where each goes (`ours`: this
        module's name in the decoder, "layers.N.mlp"). Under tensor parallelism, each expert's share of the
        intermediate rows (its gate, up and down), and the down bias on rank 0 only (sharding.py)."""
        e, i, h = self.moe.num_experts, self.moe.intermediate_size, self.hidden
        full, rank = self.full_moe.intermediate_size, 0 if self.tp is None else self.tp.rank
        split = self.tp is not None

        def rows(*starts: int) -> tuple[tuple[int, int], ...]:  # this rank's rows of each expert's
            return tuple((s + rank * i, s + rank * i + i) for s in starts)

        hf = f"model.layers.{layer}." + ("block_sparse_moe" if self.kind == "mixtral" else "mlp")
        slots: dict[str, Slot] = {}
        router = "router" if self.kind == "gpt_oss" else "gate"
        slots[f"{hf}.{router}.weight"] = Slot(f"{ours}.gate.weight", self.gate.weight, 0, e)
        if self.gate.bias is not None:
            slots[f"{hf}.{router}.bias"] = Slot(f"{ours}.gate.bias", self.gate.bias, 0, e)
        if self.kind == "gpt_oss":  # fused tensors, converted by gpt_oss_layout before they reach fill
            gu = rows(*(x * 2 * full + half * full for x in range(e) for half in (0, 1)))
            gu_shard = Shard((e * 2 * full, h), 0, gu) if split else None
            down_shard = Shard((e * h, full), 1, rows(0)) if split else None
            slots[f"{hf}.experts.gate_up_proj"] = Slot(
                f"{ours}.gate_up", self.gate_up, 0, e * 2 * i, shard=gu_shard
            )
            slots[f"{hf}.experts.down_proj"] = Slot(f"{ours}.down", self.down, 0, e * h, shard=down_shard)
            assert self.gate_up_bias is not None and self.down_bias is not None
            slots[f"{hf}.experts.gate_up_proj_bias"] = Slot(
                f"{ours}.gate_up_bias", self.gate_up_bias, 0, e * 2 * i,
                shard=Shard((e * 2 * full,), 0, gu) if split else None,
            )  # fmt: skip
            slots[f"{hf}.experts.down_proj_bias"] = Slot(
                f"{ours}.down_bias",
                self.down_bias,
                0,
                e * h,
                0.0 if rank else 1.0,  # added once, by rank 0
            )
            return slots
        gate, up, down = (
            ("w1", "w3", "w2") if self.kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )
        part = Shard((full, h), 0, rows(0)) if split else None
        cols = Shard((h, full), 1, rows(0)) if split else None
        for x in range(e):
            p = f"{hf}.experts.{x}"
            a, b = x * 2 * i, (x + 1) * 2 * i
            slots[f"{p}.{gate}.weight"] = Slot(f"{ours}.gate_up", self.gate_up, a, a + i, shard=part)
            slots[f"{p}.{up}.weight"] = Slot(f"{ours}.gate_up", self.gate_up, a + i, b, shard=part)
            slots[f"{p}.{down}.weight"] = Slot(f"{ours}.down", self.down, x * h, (x + 1) * h, shard=cols)
        return slots


def gpt_oss_layout(name: str, w: Tensor, moe: MoESpec) -> Tensor:
    """A gpt-oss checkpoint's fused expert tensor -> our layout: gate_up_proj [E, hidden, 2I] (gate and up
    interleaved along 2I) -> [E * 2I, hidden], each expert's gate rows then its up rows; its bias [E, 2I]
    likewise -> [E * 2I]; down_proj [E, I, hidden] -> [E * hidden, I]; down_proj_bias [E, hidden] -> [E *
    hidden]. A tensor of another shape passes through unchanged (fill then names the mismatch)."""
    e, i = moe.num_experts, moe.intermediate_size
    if name.endswith("gate_up_proj") and w.dim() == 3 and w.shape[0] == e and w.shape[2] == 2 * i:
        w = w.transpose(1, 2)  # [E, 2I, hidden]
        return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).reshape(e * 2 * i, -1).contiguous()
    if name.endswith("gate_up_proj_bias") and w.shape == (e, 2 * i):
        return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).reshape(-1).contiguous()
    if name.endswith("down_proj") and w.dim() == 3 and w.shape[:2] == (e, i):
        return w.transpose(1, 2).reshape(-1, i).contiguous()
    if name.endswith("down_proj_bias") and w.dim() == 2 and w.shape[0] == e:
        return w.reshape(-1).contiguous()
    return w
