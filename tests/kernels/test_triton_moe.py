"""The Triton grouped MoE kernels (worker/kernels/triton_moe.py) against the torch reference
(moe_methods.experts_reference): tokens 1..40, 4 to 8 experts, top-k 1, 2 and 4, both activations, biased
and not, shapes that do not fill a tile; the block plan's invariants; on a GPU when there is one, else
under the Triton interpreter."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest
import torch

from tests.kernels.conftest import ON_GPU
from worker.kernels.experts import ExpertActivation, Experts
from worker.kernels.moe_methods import experts_reference


@pytest.fixture(scope="module")
def tm() -> ModuleType:
    mod = importlib.import_module("worker.kernels.triton_moe")
    if not ON_GPU and not mod.interpreted():
        mod = importlib.reload(sys.modules["worker.kernels.triton_moe"])
    return mod


@pytest.mark.parametrize("t", [1, 5, 40])
@pytest.mark.parametrize(("e", "k"), [(4, 1), (8, 2), (6, 4)])
@pytest.mark.parametrize(("h", "inter", "act"), [(64, 32, "silu"), (40, 24, "clamped_swiglu")])
def test_grouped_gemms_match_the_torch_reference(
    tm: ModuleType, t: int, e: int, k: int, h: int, inter: int, act: str
) -> None:
    gen = torch.Generator().manual_seed(t * 100 + e * 10 + k)
    device = torch.device("cuda" if ON_GPU else "cpu")
    x = torch.randn(t, h, generator=gen)
    gate_up = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    down = torch.randn(e, h, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen) + 0.1
    biased = act == "clamped_swiglu"
    gu_bias = torch.randn(e, 2 * inter, generator=gen) if biased else None
    d_bias = torch.randn(e, h, generator=gen) if biased else None
    experts = Experts(gate_up, down, ExpertActivation(act, 1.702, 1.5), gu_bias, d_bias)
    want = experts_reference(x, ids, w, experts)
    on = Experts(
        gate_up.to(device),
        down.to(device),
        experts.activation,
        None if gu_bias is None else gu_bias.to(device),
        None if d_bias is None else d_bias.to(device),
    )
    got = tm.moe_experts(x.to(device), ids.to(device), w.to(device), on)
    # tl.dot's float32 runs TF32 on a GPU
    tol = 2e-2 if ON_GPU else 1e-5
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


def test_each_block_holds_one_experts_rows_in_token_order(tm: ModuleType) -> None:
    ids = torch.tensor([[3, 0], [0, 1], [3, 2], [0, 3]])
    slots, block_expert = tm.expert_blocks(ids, 4, block_m=2)
    flat = ids.reshape(-1)
    seen = []
    for b, ex in enumerate(block_expert.tolist()):
        rows = [s for s in slots[b * 2 : b * 2 + 2].tolist() if s >= 0]
        if ex < 0:
            assert not rows
            continue
        assert rows and all(int(flat[s]) == ex for s in rows) and rows == sorted(rows)
        seen += rows
    assert sorted(seen) == list(range(flat.numel()))  # every slot once


def test_a_tokens_experts_output_has_the_same_bits_in_any_step(tm: ModuleType, device: torch.device) -> None:
    # Batch invariance: the tiles are fixed (BLOCK_M, BLOCK_N, BLOCK_K never follow the step's tokens), a
    # row's place in its expert's blocks changes no sum of it, and its picks add in expert order; so a
    # token's output is the same alone, beside a few tokens and beside many that crowd its experts.
    gen = torch.Generator().manual_seed(5)
    e, k, h, inter, t = 8, 2, 64, 32, 40
    gate_up = (torch.randn(e, 2 * inter, h, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    down = (torch.randn(e, h, inter, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    experts = Experts(gate_up, down, ExpertActivation("silu"))
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    weights = torch.softmax(torch.randn(t, k, generator=gen), dim=-1).to(device)

    def run(rows: slice) -> torch.Tensor:
        return tm.moe_experts(x[rows], ids[rows], weights[rows], experts)

    full = run(slice(0, t))
    for rows in (slice(0, 1), slice(3, 4), slice(0, 5), slice(10, 27)):
        assert torch.equal(run(rows), full[rows]), rows
